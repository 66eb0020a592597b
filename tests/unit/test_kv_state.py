"""KvState, the router's view of the target's KV: its page mirror equals a PageAllocator fed the
ops it returns (as the target is), and its prefix cache follows the same sequences."""

import random

import pytest

from router.kv_state import KvState
from tandem.errors import FailedPrecondition
from tandem.kv.pages import PageAllocator
from tandem.ops import AddSequence, ForkSequence, PopTokens, RemoveSequence
from tandem.sampling.params import SamplingParams

GREEDY = SamplingParams(temperature=0.0)


class Mirror:
    """A KvState and the target's allocator, each op applied to both, compared after each."""

    def __init__(self, num_pages: int = 16, page_size: int = 4, max_recycling: int = -1, window: int = 0):
        self.kv = KvState(num_pages, page_size, max_held=64, max_recycling=max_recycling, sliding_window=window)
        self.target = PageAllocator(num_pages, page_size)

    def apply(self, ops: list) -> list:
        for op in ops:
            if isinstance(op, AddSequence):
                self.target.add(op.seq_id)
            elif isinstance(op, ForkSequence):
                self.target.fork(op.seq_id, op.parent_id, op.position)
            elif isinstance(op, PopTokens):
                self.target.pop(op.seq_id, op.count)
            elif isinstance(op, RemoveSequence):
                self.target.remove(op.seq_id)
            else:
                raise AssertionError(f"unexpected op {op}")
        self.check()
        return ops

    def feed(self, seq_id: int, tokens, rejected: int = 0) -> None:
        """A step's tokens for seq_id, the last `rejected` of them popped (rejected drafts)."""
        self.kv.append(seq_id, len(tokens))
        self.target.append(seq_id, len(tokens))
        if rejected:
            self.kv.pop(seq_id, rejected)
            self.target.pop(seq_id, rejected)
        self.kv.commit(seq_id, tokens[: len(tokens) - rejected])
        self.check()

    def check(self) -> None:
        kv, target = self.kv, self.target
        assert sorted(kv.pages.seq_ids()) == sorted(target.seq_ids())
        for seq_id in target.seq_ids():
            assert kv.pages.page_table(seq_id) == target.page_table(seq_id)
            assert kv.length(seq_id) == target.length(seq_id)
            assert len(kv.cache.sequence_tokens(seq_id)) == kv.length(seq_id)  # the cache mirrors the KV
        assert kv.free_pages == target.num_free_pages
        assert kv.held == target.num_sequences == kv.cache.num_sequences()


def test_the_page_mirror_follows_add_fork_child_reuse_pop_evict_and_remove():
    m = Mirror()
    a = list(range(10))
    assert m.kv.add_root(1, a, GREEDY, draft_lags=False) == ([AddSequence(1, GREEDY)], 0)
    m.apply([AddSequence(1, GREEDY)])
    m.feed(1, a)
    # A live match: fork at the common prefix; the shared partly filled page is copied on write.
    ops, cached = m.kv.add_root(2, a[:6] + [50, 51], GREEDY, draft_lags=False)
    assert (ops, cached) == ([ForkSequence(2, 1, 6, GREEDY)], 6)
    m.apply(ops)
    m.feed(2, [50, 51])
    assert m.kv.cache.sequence_tokens(2) == a[:6] + [50, 51]
    assert m.apply(m.kv.fork_child(3, 2, GREEDY, draft_lags=True)) == [
        ForkSequence(3, 2, 8, GREEDY, draft_position=7)]
    m.feed(3, [60])
    assert m.kv.recycle(1) == [] and m.kv.recycled_ids() == [1] and m.kv.recycled_total == 1
    # A lagging draft reuses the recycled one a token early: its pages change hands, none is freed.
    free = m.kv.free_pages
    ops, cached = m.kv.add_root(4, a + [70], GREEDY, draft_lags=True)
    assert (ops, cached) == ([ForkSequence(4, 1, 9, GREEDY), RemoveSequence(1)], 9)
    m.apply(ops)
    assert m.kv.free_pages == free and m.kv.cache.sequence_tokens(4) == a[:9]
    m.feed(4, [9, 70, 71, 72], rejected=2)  # the last page is its own now: no copy
    assert m.kv.cache.sequence_tokens(4) == a + [70]
    assert m.kv.evict() == []  # nothing recycled
    assert m.kv.recycle(2) == [] and m.kv.recycle(3) == []
    assert m.apply(m.kv.evict()) == [RemoveSequence(2)] and m.kv.evicted_total == 1
    assert m.apply(m.kv.remove(4)) == [RemoveSequence(4)]
    assert m.apply(m.kv.evict()) == [RemoveSequence(3)] and m.kv.evicted_total == 2
    assert m.kv.held == 0 and m.kv.free_pages == 16


def test_the_page_mirror_matches_the_allocator_under_random_ops():
    rng = random.Random(1)
    m = Mirror(num_pages=48, page_size=4, max_recycling=4)
    live: list[int] = []
    for seq_id in range(1, 400):
        roll = rng.random()
        if m.kv.free_pages < 10:
            ops = m.kv.evict() or m.kv.remove(live.pop(0))
        elif roll < 0.3 or not live:
            tokens = [rng.randrange(3) for _ in range(rng.randint(1, 10))]
            ops, cached = m.kv.add_root(seq_id, tokens, GREEDY, draft_lags=rng.random() < 0.5)
            m.apply(ops)
            assert 0 <= cached < len(tokens) and m.kv.cache.sequence_tokens(seq_id) == tokens[:cached]
            m.feed(seq_id, tokens[cached:])
            live.append(seq_id)
            continue
        elif roll < 0.4:
            ops = m.kv.fork_child(seq_id, rng.choice(live), GREEDY, draft_lags=rng.random() < 0.5)
            m.apply(ops)
            m.feed(seq_id, [rng.randrange(3)])
            live.append(seq_id)
            continue
        elif roll < 0.75:
            drafts = rng.randrange(4)
            m.feed(rng.choice(live), [rng.randrange(3) for _ in range(1 + drafts)], rejected=rng.randint(0, drafts))
            continue
        elif roll < 0.9:
            ops = m.kv.recycle(live.pop(rng.randrange(len(live))))
        else:
            ops = m.kv.remove(live.pop(rng.randrange(len(live))))
        m.apply(ops)
        assert m.kv.cache.num_recycled() <= 4
    assert m.kv.recycled_total > 0 and m.kv.evicted_total > 0
    for seq_id in list(live):
        m.apply(m.kv.remove(seq_id))
    while ops := m.kv.evict():
        m.apply(ops)
    assert m.kv.held == 0 and m.kv.free_pages == 48


@pytest.mark.parametrize(("parent_length", "draft_lags", "draft_position"), [
    (5, True, 4), (5, False, None), (8, True, 7), (0, True, 0), (0, False, None),
])
def test_a_child_forks_at_its_parents_length_and_a_lagging_draft_one_earlier(parent_length, draft_lags, draft_position):
    m = Mirror()
    m.apply(m.kv.add_root(1, list(range(parent_length + 1)), GREEDY, draft_lags=False, is_parent=True)[0])
    m.feed(1, list(range(parent_length)))
    sampler = SamplingParams(seed=3)
    ops = m.apply(m.kv.fork_child(2, 1, sampler, draft_lags))
    assert ops == [ForkSequence(2, 1, parent_length, sampler, draft_position=draft_position)]
    assert m.kv.cache.sequence_tokens(2) == list(range(parent_length))


def test_a_root_matches_only_eligible_sequences():
    m = Mirror()
    m.apply(m.kv.add_root(1, [1, 2, 3, 4], GREEDY, draft_lags=False)[0])
    m.feed(1, [1, 2, 3, 4])
    assert m.kv.add_root(2, [1, 2, 3, 9], GREEDY, draft_lags=False, eligible=lambda s: False) == (
        [AddSequence(2, GREEDY)], 0)
    assert m.kv.add_root(3, [1, 2, 3, 9], GREEDY, draft_lags=False, eligible=lambda s: s == 1) == (
        [ForkSequence(3, 1, 3, GREEDY)], 3)


def test_a_one_token_match_with_a_lagging_draft_is_an_add():
    m = Mirror()
    m.apply(m.kv.add_root(1, [1, 2], GREEDY, draft_lags=False)[0])
    m.feed(1, [1, 2])
    ops, cached = m.kv.add_root(2, [1, 5], GREEDY, draft_lags=True)
    assert (ops, cached) == ([AddSequence(2, GREEDY)], 0)
    m.apply(ops)
    assert m.kv.cache.sequence_tokens(2) == []


def test_a_sliding_window_root_never_forks_but_reuses_a_whole_recycled_match():
    m = Mirror(window=8)
    m.apply(m.kv.add_root(1, [1, 2, 3, 4], GREEDY, draft_lags=False)[0])
    m.feed(1, [1, 2, 3, 4])
    assert m.kv.add_root(2, [1, 2, 3, 9], GREEDY, draft_lags=False)[0] == [AddSequence(2, GREEDY)]
    m.apply([AddSequence(2, GREEDY)])
    m.kv.recycle(1)
    ops, cached = m.kv.add_root(3, [1, 2, 3, 4, 5], GREEDY, draft_lags=False)
    assert (ops, cached) == ([ForkSequence(3, 1, 4, GREEDY), RemoveSequence(1)], 4)
    m.apply(ops)


def test_a_parent_has_no_sliding_window_so_children_can_fork_it():
    m = Mirror(window=8)
    m.apply(m.kv.add_root(1, [1, 2, 3], GREEDY, draft_lags=False, is_parent=True)[0])
    m.feed(1, [1, 2])
    m.apply(m.kv.fork_child(2, 1, GREEDY, draft_lags=False))
    m.apply(m.kv.add_root(3, [7, 8, 9], GREEDY, draft_lags=False)[0])
    m.feed(3, [7, 8])
    with pytest.raises(FailedPrecondition):
        m.kv.fork_child(4, 3, GREEDY, draft_lags=False)  # a sequence with a window cannot be forked


def test_recycling_off_removes_the_finished_sequence_and_a_limit_evicts_the_oldest():
    off = Mirror(max_recycling=0)
    off.apply(off.kv.add_root(1, [1, 2], GREEDY, draft_lags=False)[0])
    assert off.apply(off.kv.recycle(1)) == [RemoveSequence(1)] and off.kv.held == 0
    one = Mirror(max_recycling=1)
    for seq_id in (1, 2):
        one.apply(one.kv.add_root(seq_id, [seq_id, 9], GREEDY, draft_lags=False)[0])
    assert one.kv.recycle(1) == []
    assert one.apply(one.kv.recycle(2)) == [RemoveSequence(1)] and one.kv.recycled_ids() == [2]


def test_new_pages_bound_covers_a_fork_copy_and_reset_drops_everything():
    m = Mirror(num_pages=16, page_size=4)
    assert [m.kv.new_pages_bound(n) for n in (1, 4, 5, 8)] == [2, 2, 3, 3]
    m.apply(m.kv.add_root(1, [1, 2, 3, 4, 5, 6], GREEDY, draft_lags=False)[0])
    m.feed(1, [1, 2, 3, 4, 5, 6])
    ops, cached = m.kv.add_root(2, [1, 2, 3, 4, 5, 7, 8, 9, 10], GREEDY, draft_lags=False)
    assert (m.apply(ops), cached) == ([ForkSequence(2, 1, 5, GREEDY)], 5)
    # 4 new tokens after a fork inside a shared page: a copy and one more page, within the bound.
    assert m.kv.pages_needed(2, 4) == 2 == m.kv.new_pages_bound(4)
    m.feed(2, [7, 8, 9, 10])
    m.kv.reset()
    assert m.kv.held == 0 and m.kv.free_pages == 16 and m.kv.cache.num_sequences() == 0
