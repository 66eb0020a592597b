"""PageAllocator, model-based: random operations against a fake KV slot array.

Every appended token writes a unique label into the slot the allocator returned (after performing
the PageCopy instructions, as the tensor layer does). Reading `slots(seq)` back from that array
must give exactly the labels the sequence was built from; a missing or misdirected copy, or a
write into a page another sequence holds, shows up as a wrong label.
"""

import random

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tandem.errors import ResourceExhausted
from tandem.kv.pages import PageAllocator, pages_for


class Model:
    """The allocator next to a fake KV slot array and each sequence's expected labels."""

    def __init__(self, num_pages: int, page_size: int):
        self.alloc = PageAllocator(num_pages, page_size)
        self.page_size = page_size
        self.kv: list[object] = [None] * (num_pages * page_size)
        self.tokens: dict[int, list[int]] = {}
        self.next_id = 0
        self.next_label = 0

    def add(self) -> int:
        seq_id = self.next_id
        self.next_id += 1
        self.alloc.add(seq_id)
        self.tokens[seq_id] = []
        return seq_id

    def fork(self, parent: int, position: int) -> int:
        seq_id = self.next_id
        self.next_id += 1
        self.alloc.fork(seq_id, parent, position)
        self.tokens[seq_id] = self.tokens[parent][:position]
        return seq_id

    def append(self, seq_id: int, num_tokens: int) -> None:
        free = self.alloc.num_free_pages
        needed = self.alloc.pages_needed(seq_id, num_tokens)
        before = (self.alloc.length(seq_id), self.alloc.page_table(seq_id))
        if needed > free:
            with pytest.raises(ResourceExhausted):
                self.alloc.append(seq_id, num_tokens)
            assert (self.alloc.length(seq_id), self.alloc.page_table(seq_id)) == before
            assert self.alloc.num_free_pages == free
            return
        slots, copies = self.alloc.append(seq_id, num_tokens)
        assert free - self.alloc.num_free_pages == needed
        assert len(slots) == num_tokens and len(copies) <= 1
        ps = self.page_size
        for c in copies:  # what PagedKVCache.apply_copies does, on labels
            assert 0 < c.num_slots < ps
            self.kv[c.dst * ps : c.dst * ps + c.num_slots] = self.kv[c.src * ps : c.src * ps + c.num_slots]
        for slot in slots:
            self.kv[slot] = self.next_label
            self.tokens[seq_id].append(self.next_label)
            self.next_label += 1

    def pop(self, seq_id: int, num_tokens: int) -> None:
        self.alloc.pop(seq_id, num_tokens)
        del self.tokens[seq_id][len(self.tokens[seq_id]) - num_tokens :]

    def remove(self, seq_id: int) -> None:
        self.alloc.remove(seq_id)
        del self.tokens[seq_id]

    def check(self) -> None:
        alloc = self.alloc
        assert sorted(alloc.seq_ids()) == sorted(self.tokens)
        in_use: set[int] = set()
        for seq_id, labels in self.tokens.items():
            assert alloc.length(seq_id) == len(labels)
            table = alloc.page_table(seq_id)
            assert len(table) == pages_for(len(labels), self.page_size)
            assert len(set(table)) == len(table)
            assert [self.kv[s] for s in alloc.slots(seq_id)] == labels, seq_id
            in_use.update(table)
        free = alloc._free
        assert len(set(free)) == len(free)
        assert not in_use & set(free)
        assert alloc.num_free_pages + len(in_use) == alloc.num_pages

    def remove_all(self) -> None:
        for seq_id in list(self.tokens):
            self.remove(seq_id)
        assert self.alloc.num_sequences == 0
        assert self.alloc.num_free_pages == self.alloc.num_pages


class AllocatorMachine(RuleBasedStateMachine):
    @initialize(num_pages=st.integers(1, 10), page_size=st.sampled_from([1, 2, 3, 4]))
    def setup(self, num_pages, page_size):
        self.m = Model(num_pages, page_size)

    @rule()
    def add(self):
        self.m.add()

    @precondition(lambda self: self.m.tokens)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(sorted(self.m.tokens)))
        position = data.draw(st.integers(0, len(self.m.tokens[parent])))
        self.m.fork(parent, position)

    @precondition(lambda self: self.m.tokens)
    @rule(data=st.data(), num_tokens=st.integers(0, 9))
    def append(self, data, num_tokens):
        self.m.append(data.draw(st.sampled_from(sorted(self.m.tokens))), num_tokens)

    @precondition(lambda self: self.m.tokens)
    @rule(data=st.data())
    def pop(self, data):
        seq_id = data.draw(st.sampled_from(sorted(self.m.tokens)))
        self.m.pop(seq_id, data.draw(st.integers(0, len(self.m.tokens[seq_id]))))

    @precondition(lambda self: self.m.tokens)
    @rule(data=st.data())
    def remove(self, data):
        self.m.remove(data.draw(st.sampled_from(sorted(self.m.tokens))))

    @invariant()
    def consistent(self):
        if hasattr(self, "m"):
            self.m.check()

    def teardown(self):
        if hasattr(self, "m"):
            self.m.remove_all()


AllocatorMachine.TestCase.settings = settings(
    max_examples=100,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestAllocatorMachine = AllocatorMachine.TestCase


@pytest.mark.parametrize("seed", range(20))
def test_random_walk_keeps_sequences_isolated(seed):
    """Longer seeded walks than hypothesis runs, with a few pages so exhaustion happens."""
    rng = random.Random(seed)
    m = Model(num_pages=rng.randint(3, 12), page_size=rng.choice([1, 2, 4, 8]))
    for _ in range(300):
        live = sorted(m.tokens)
        op = rng.choice(["add", "fork", "append", "append", "append", "pop", "remove"]) if live else "add"
        if op == "add" and len(live) < 8:
            m.add()
        elif op == "fork" and len(live) < 8:
            parent = rng.choice(live)
            m.fork(parent, rng.randint(0, len(m.tokens[parent])))
        elif op == "append":
            m.append(rng.choice(live), rng.randint(0, 6))
        elif op == "pop":
            seq_id = rng.choice(live)
            m.pop(seq_id, rng.randint(0, len(m.tokens[seq_id])))
        elif op == "remove":
            m.remove(rng.choice(live))
        m.check()
    m.remove_all()
