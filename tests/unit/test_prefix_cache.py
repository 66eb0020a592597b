"""The radix prefix cache: literal cases, the EAGLE roll-back rule, and a stateful model test."""

from collections import OrderedDict

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition,
                                 rule)

from router.prefix_cache import PrefixCache, PrefixMatch, SequenceOps, plan_sequence_ops
from tandem.errors import FailedPrecondition, InvalidArgument, NotFound


def cache_with(max_recycling: int = -1, **seqs: list[int]) -> PrefixCache:
    """A cache holding live sequences s1, s2, ... (keyword `s<id>`) with those tokens."""
    cache = PrefixCache(max_recycling)
    for name, tokens in seqs.items():
        seq_id = int(name[1:])
        cache.insert_sequence(seq_id, [99])
        cache.extend_sequence(seq_id, tokens)
    return cache


def test_no_match_adds_an_empty_sequence():
    cache = PrefixCache(4)
    assert cache.insert_sequence(1, [5, 6, 7]) == PrefixMatch(0, None, None, 0)
    assert cache.has_sequence(1) and not cache.is_recycled(1)
    assert cache.sequence_tokens(1) == []
    cache.extend_sequence(1, [5, 6, 7])
    assert cache.insert_sequence(2, [8, 5, 6]) == PrefixMatch(0)


def test_match_on_a_live_sequence_forks():
    cache = cache_with(s1=[1, 2, 3, 4])
    assert cache.insert_sequence(2, [1, 2, 3, 9]) == PrefixMatch(3, forked_seq_id=1)
    assert cache.sequence_tokens(2) == [1, 2, 3]
    assert cache.sequence_tokens(1) == [1, 2, 3, 4]


def test_the_last_token_is_never_matched():
    cache = cache_with(s1=[1, 2, 3, 4])
    assert cache.insert_sequence(2, [1, 2, 3, 4]) == PrefixMatch(3, forked_seq_id=1)
    assert cache.insert_sequence(3, [1]) == PrefixMatch(0)
    assert cache.insert_sequence(4, [1, 2]) == PrefixMatch(1, forked_seq_id=1)


def test_the_longest_match_wins():
    cache = cache_with(s1=[1, 2, 7], s2=[1, 2, 3, 4], s3=[1, 9])
    assert cache.insert_sequence(4, [1, 2, 3, 5, 6]) == PrefixMatch(3, forked_seq_id=2)


def test_match_on_a_recycled_sequence_reuses_it_with_pop():
    cache = cache_with(s1=list(range(20)))
    assert cache.recycle_sequence(1) == []
    match = cache.insert_sequence(2, list(range(19)) + [50, 51])
    assert match == PrefixMatch(19, reused_seq_id=1, reused_seq_pop_last_tokens=1)
    # The new sequence takes it over under its own id: the recycled one is gone.
    assert not cache.has_sequence(1) and cache.num_recycled() == 0
    assert cache.sequence_tokens(2) == list(range(19)) and not cache.is_recycled(2)
    cache.extend_sequence(2, [50])  # live


def test_whole_recycled_sequence_is_reused_without_pop():
    cache = cache_with(s1=[1, 2, 3])
    cache.recycle_sequence(1)
    assert cache.insert_sequence(2, [1, 2, 3, 4, 5]) == PrefixMatch(3, reused_seq_id=1)


def test_part_of_a_recycled_sequence_is_forked_not_reused():
    # Matched 9 of 10 tokens: 9 > 0.9 * 10 fails, so popping a tenth is too much: fork.
    cache = cache_with(s1=list(range(10)))
    cache.recycle_sequence(1)
    assert cache.insert_sequence(2, list(range(9)) + [77]) == PrefixMatch(9, forked_seq_id=1)
    assert cache.is_recycled(1) and cache.sequence_tokens(1) == list(range(10))


def test_the_shortest_recycled_sequence_is_reused():
    # Both hold the 11 matched tokens and would pop at most a tenth: the shorter pops less.
    cache = cache_with(s1=list(range(12)), s2=list(range(11)), s3=list(range(13)))
    for seq_id in (1, 2, 3):
        cache.recycle_sequence(seq_id)
    match = cache.insert_sequence(4, list(range(11)) + [99, 100])
    assert match == PrefixMatch(11, reused_seq_id=2)


def test_reuse_beats_a_fork_of_equal_length_but_not_a_longer_one():
    cache = cache_with(s1=[1, 2, 3], s2=[1, 2, 3, 4, 5, 6])
    cache.recycle_sequence(1)
    assert cache.insert_sequence(3, [1, 2, 3, 8]) == PrefixMatch(3, reused_seq_id=1)
    cache = cache_with(s1=[1, 2, 3], s2=[1, 2, 3, 4, 5, 6])
    cache.recycle_sequence(1)
    assert cache.insert_sequence(3, [1, 2, 3, 4, 8]) == PrefixMatch(4, forked_seq_id=2)


def test_extend_and_rollback_change_later_matches():
    cache = cache_with(s1=[1, 2])
    cache.extend_sequence(1, [3, 4])
    assert cache.insert_sequence(2, [1, 2, 3, 4, 5]) == PrefixMatch(4, forked_seq_id=1)
    cache.rollback_sequence(1, 3)
    cache.rollback_sequence(2, 4)
    assert cache.sequence_tokens(1) == [1] and cache.sequence_tokens(2) == []
    assert cache.insert_sequence(3, [1, 2, 3, 4, 5]) == PrefixMatch(1, forked_seq_id=1)
    cache.rollback_sequence(1, 1)
    assert cache.insert_sequence(4, [1, 2, 3]) == PrefixMatch(1, forked_seq_id=3)


def test_fork_sequence_shares_the_parent_prefix():
    cache = cache_with(s1=[1, 2, 3, 4])
    cache.fork_sequence(2, 1, 2)
    assert cache.sequence_tokens(2) == [1, 2]
    cache.extend_sequence(2, [8, 9])
    assert cache.insert_sequence(3, [1, 2, 8, 9, 0]) == PrefixMatch(4, forked_seq_id=2)
    assert cache.sequence_tokens(1) == [1, 2, 3, 4]


def test_recycled_sequences_are_evicted_least_recently_recycled_first():
    cache = cache_with(2, s1=[1], s2=[2], s3=[3], s4=[4])
    assert cache.recycle_sequence(3) == []
    assert cache.recycle_sequence(1) == []
    assert cache.recycle_sequence(2) == [3]
    assert not cache.has_sequence(3) and cache.num_recycled() == 2
    assert cache.try_free_memory() == [1]
    assert cache.try_free_memory() == [2]
    assert cache.try_free_memory() == []
    assert cache.num_sequences() == 1 and not cache.is_recycled(4)


def test_recycling_limit_zero_removes_at_once_and_minus_one_keeps_all():
    cache = cache_with(0, s1=[1, 2])
    assert cache.recycle_sequence(1) == [1]
    assert not cache.has_sequence(1) and cache.num_recycled() == 0
    cache = PrefixCache(-1)
    for seq_id in range(50):
        cache.insert_sequence(seq_id, [seq_id, 0])
        assert cache.recycle_sequence(seq_id) == []
    assert cache.num_recycled() == 50


def test_sliding_window_sequences():
    window = dict(sliding_window_size=8, attention_sink_size=2)
    cache = cache_with(s1=[1, 2, 3, 4])
    # A sliding-window sequence never forks, not even from a plain one.
    assert cache.insert_sequence(2, [1, 2, 3, 9], **window) == PrefixMatch(0)
    cache.extend_sequence(2, [1, 2, 3])
    # Nor does a plain sequence fork from a sliding-window one: it forks the plain one.
    assert cache.insert_sequence(3, [1, 2, 3, 7]) == PrefixMatch(3, forked_seq_id=1)
    cache.remove_sequence(1)
    cache.remove_sequence(3)
    assert cache.insert_sequence(4, [1, 2, 3, 7]) == PrefixMatch(0)
    # A recycled sliding-window sequence is reused only whole (no pop) and with equal settings.
    cache.recycle_sequence(2)
    assert cache.insert_sequence(5, [1, 2, 9], **window) == PrefixMatch(0)
    assert cache.insert_sequence(6, [1, 2, 3, 5], sliding_window_size=8) == PrefixMatch(0)
    assert cache.insert_sequence(7, [1, 2, 3, 5], **window) == PrefixMatch(3, reused_seq_id=2)
    with pytest.raises(FailedPrecondition):
        cache.fork_sequence(8, 7, 1)


def test_contract_errors():
    cache = cache_with(s1=[1, 2])
    with pytest.raises(FailedPrecondition):
        cache.insert_sequence(1, [1])
    with pytest.raises(InvalidArgument):
        cache.insert_sequence(2, [])
    with pytest.raises(InvalidArgument):
        cache.insert_sequence(2, [1], sliding_window_size=0)
    with pytest.raises(InvalidArgument):
        cache.rollback_sequence(1, 3)
    with pytest.raises(InvalidArgument):
        cache.fork_sequence(2, 1, 3)
    with pytest.raises(NotFound):
        cache.extend_sequence(9, [1])
    cache.recycle_sequence(1)
    for call in (lambda: cache.extend_sequence(1, [3]), lambda: cache.rollback_sequence(1, 1),
                 lambda: cache.recycle_sequence(1)):
        with pytest.raises(FailedPrecondition):
            call()
    cache.reset()
    assert cache.num_sequences() == 0 and cache.num_recycled() == 0


# --- the EAGLE roll-back rule (DESIGN.md section 3) ---


def test_eagle_worked_example_fork():
    # Target KV holds [0, 1, 2]; the draft's KV lags by one: [1, 2, 3] (3 sampled, not yet in
    # the target's KV). A new prompt [0, 1, 4] matches 2 tokens but forks at 1.
    target_kv, draft_kv, sampled = [0, 1, 2], [1, 2, 3], 5
    cache = cache_with(s1=target_kv)
    prompt = [0, 1, 4]
    match = cache.insert_sequence(2, prompt)
    assert match == PrefixMatch(2, forked_seq_id=1)
    ops = plan_sequence_ops(2, match, draft_lags=True)
    assert ops == SequenceOps(2, forked_seq_id=1, fork_offset=1, num_prefilled=1,
                              cache_rollback=1)
    target_prefill = prompt[ops.num_prefilled:]
    draft_prefill = prompt[ops.num_prefilled + 1:] + [sampled]
    assert target_prefill == [1, 4] and draft_prefill == [4, 5]
    new_target_kv = target_kv[:ops.fork_offset] + target_prefill
    new_draft_kv = draft_kv[:ops.fork_offset] + draft_prefill
    assert new_target_kv == [0, 1, 4] and new_draft_kv == [1, 4, 5]
    cache.rollback_sequence(ops.seq_id, ops.cache_rollback)
    assert cache.sequence_tokens(2) == target_kv[:ops.fork_offset]


def test_eagle_reuse_pops_one_more_token():
    cache = cache_with(s1=[0, 1, 2, 3])
    cache.recycle_sequence(1)
    match = cache.insert_sequence(2, [0, 1, 2, 3, 4])
    assert match == PrefixMatch(4, reused_seq_id=1)
    ops = plan_sequence_ops(2, match, draft_lags=True)
    # Reuse = fork where the match ends (one token earlier for a lagging draft) + remove.
    assert ops == SequenceOps(2, forked_seq_id=1, fork_offset=3, reused_seq_id=1,
                              num_prefilled=3, cache_rollback=1)
    cache.rollback_sequence(ops.seq_id, ops.cache_rollback)
    assert cache.sequence_tokens(2) == [0, 1, 2] and not cache.has_sequence(1)
    assert plan_sequence_ops(2, match, draft_lags=False) == SequenceOps(
        2, forked_seq_id=1, fork_offset=4, reused_seq_id=1, num_prefilled=4)
    # A one-token reuse under a lagging draft is an add + remove.
    assert plan_sequence_ops(2, PrefixMatch(1, reused_seq_id=1), draft_lags=True) == SequenceOps(
        2, reused_seq_id=1, cache_rollback=1)


def test_eagle_fork_at_zero_is_an_add_and_plain_mode_forks_where_matched():
    match = PrefixMatch(1, forked_seq_id=7)
    assert plan_sequence_ops(3, match, draft_lags=True) == SequenceOps(3, cache_rollback=1)
    assert plan_sequence_ops(3, match, draft_lags=False) == SequenceOps(
        3, forked_seq_id=7, fork_offset=1, num_prefilled=1)
    assert plan_sequence_ops(3, PrefixMatch(), draft_lags=True) == SequenceOps(3)


# --- random operation sequences against a simple model ---


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


TOKENS = st.lists(st.integers(0, 2), min_size=0, max_size=5)
WINDOWS = st.sampled_from([(-1, 0)] * 4 + [(4, 0), (4, 1)])


class PrefixCacheMachine(RuleBasedStateMachine):
    """Model: seq_id -> tokens, seq_id -> window, recycled ids in recycling order."""

    @initialize(max_recycling=st.sampled_from([-1, 3, 2, 1, 0]),
                fraction=st.sampled_from([0.9, 0.5, 0.0]))
    def setup(self, max_recycling, fraction):
        self.cache = PrefixCache(max_recycling, reuse_min_fraction=fraction)
        self.max_recycling, self.fraction = max_recycling, fraction
        self.tokens: dict[int, list[int]] = {}
        self.window: dict[int, tuple[int, int]] = {}
        self.recycled: OrderedDict[int, None] = OrderedDict()
        self.next_id = 0

    def new_id(self) -> int:
        self.next_id += 1
        return self.next_id

    def live(self) -> list[int]:
        return sorted(s for s in self.tokens if s not in self.recycled)

    def reusable(self, seq_id: int, matched: int, window: tuple[int, int]) -> bool:
        length = len(self.tokens[seq_id])
        if seq_id not in self.recycled or self.window[seq_id] != window or matched == 0:
            return False
        return matched == length if window[0] != -1 else matched > self.fraction * length

    INSERT = dict(data=st.data(), tail=TOKENS, last=st.integers(0, 2), window=WINDOWS,
                  prefill=st.sampled_from([True, True, False]))

    @rule(**INSERT)
    def insert(self, data, tail, last, window, prefill):
        """Inserts a cached sequence's prefix (or nothing) + a tail."""
        self.insert_from(sorted(self.tokens), None, data, tail, last, window, prefill)

    @precondition(lambda self: self.recycled)
    @rule(**INSERT)
    def insert_near_recycled(self, data, tail, last, window, prefill):
        """Inserts a recycled sequence, but for at most its last token, + a tail."""
        self.insert_from(sorted(self.recycled), 1, data, tail, last, window, prefill)

    def insert_from(self, pool, max_cut, data, tail, last, window, prefill):
        """Inserts a pool sequence's tokens but for at most `max_cut` (None: any) last ones,
        + tail + last; if `prefill`, extends the new sequence by the unmatched tokens."""
        head = data.draw(st.sampled_from([self.tokens[s] for s in pool] or [[]]))
        cut = len(head) if max_cut is None else min(max_cut, len(head))
        head = head[:len(head) - data.draw(st.integers(0, cut))]
        seq_id, tokens = self.new_id(), head + tail + [last]
        match = self.cache.insert_sequence(seq_id, tokens, *window)
        self.check_match(match, tokens, window)
        if prefill:
            self.cache.extend_sequence(seq_id, tokens[match.prefilled_offset:])
            self.tokens[seq_id] = list(tokens)

    def check_match(self, match: PrefixMatch, tokens: list[int], window: tuple[int, int]):
        """Checks `match` against the model (longest eligible match), then applies it there."""
        seq_id = self.next_id
        lcp = {s: common_prefix(t, tokens[:-1]) for s, t in self.tokens.items()}
        reuse = [lcp[s] for s in lcp if self.reusable(s, lcp[s], window)]
        fork = [lcp[s] for s in lcp if window[0] == -1 and self.window[s][0] == -1]
        best_reuse, best_fork = max(reuse, default=0), max(fork, default=0)
        offset, matched = match.prefilled_offset, match.forked_seq_id
        matched = match.reused_seq_id if match.reused_seq_id is not None else matched
        assert 0 <= offset < len(tokens)
        if matched is not None:  # the matched prefix is one of both the prompt and the sequence
            assert offset > 0 and self.tokens[matched][:offset] == tokens[:offset]
        if match.reused_seq_id is not None:
            r = match.reused_seq_id
            assert match.forked_seq_id is None and self.reusable(r, lcp[r], window)
            assert match.prefilled_offset == lcp[r] == best_reuse >= best_fork
            shortest = min(len(self.tokens[s]) for s in lcp
                           if lcp[s] == best_reuse and self.reusable(s, lcp[s], window))
            assert len(self.tokens[r]) == shortest
            assert match.reused_seq_pop_last_tokens == len(self.tokens[r]) - lcp[r]
            del self.recycled[r]
            self.tokens[seq_id], self.window[seq_id] = self.tokens.pop(r)[:lcp[r]], window
            del self.window[r]
            return
        assert match.reused_seq_pop_last_tokens == 0 and best_reuse < max(best_fork, 1)
        if match.forked_seq_id is not None:
            f = match.forked_seq_id
            assert window[0] == -1 and self.window[f][0] == -1
            assert match.prefilled_offset == lcp[f] == best_fork > 0
        else:
            assert match.prefilled_offset == 0 and best_fork == 0
        self.tokens[seq_id] = tokens[:match.prefilled_offset]
        self.window[seq_id] = window

    @precondition(lambda self: self.live())
    @rule(data=st.data(), tokens=TOKENS)
    def extend(self, data, tokens):
        seq_id = data.draw(st.sampled_from(self.live()))
        self.cache.extend_sequence(seq_id, tokens)
        self.tokens[seq_id] += tokens

    @precondition(lambda self: self.live())
    @rule(data=st.data())
    def rollback(self, data):
        seq_id = data.draw(st.sampled_from(self.live()))
        n = data.draw(st.integers(0, len(self.tokens[seq_id])))
        self.cache.rollback_sequence(seq_id, n)
        self.tokens[seq_id] = self.tokens[seq_id][:len(self.tokens[seq_id]) - n]

    @precondition(lambda self: any(w[0] == -1 for w in self.window.values()))
    @rule(data=st.data(), window=WINDOWS)
    def fork(self, data, window):
        parent = data.draw(st.sampled_from(sorted(s for s, w in self.window.items()
                                                  if w[0] == -1)))
        offset = data.draw(st.integers(0, len(self.tokens[parent])))
        seq_id = self.new_id()
        self.cache.fork_sequence(seq_id, parent, offset, *window)
        self.tokens[seq_id] = self.tokens[parent][:offset]
        self.window[seq_id] = window

    @precondition(lambda self: self.live())
    @rule(data=st.data())
    def recycle(self, data):
        seq_id = data.draw(st.sampled_from(self.live()))
        evicted = self.cache.recycle_sequence(seq_id)
        if self.max_recycling == 0:
            expected = [seq_id]
        elif len(self.recycled) == self.max_recycling:
            expected = [next(iter(self.recycled))]
        else:
            expected = []
        assert evicted == expected
        self.recycled[seq_id] = None
        for s in expected:
            self.forget(s)

    @rule()
    def free(self):
        expected = [next(iter(self.recycled))] if self.recycled else []
        assert self.cache.try_free_memory() == expected
        for s in expected:
            self.forget(s)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def remove(self, data):
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        self.cache.remove_sequence(seq_id)
        self.forget(seq_id)

    def forget(self, seq_id: int) -> None:
        del self.tokens[seq_id], self.window[seq_id]
        self.recycled.pop(seq_id, None)

    @invariant()
    def cache_mirrors_the_model(self):
        assert self.cache.num_sequences() == len(self.tokens)
        assert self.cache.num_recycled() == len(self.recycled)
        if self.max_recycling >= 0:
            assert len(self.recycled) <= self.max_recycling
        for seq_id, tokens in self.tokens.items():
            assert self.cache.sequence_tokens(seq_id) == tokens
            assert self.cache.is_recycled(seq_id) == (seq_id in self.recycled)

    @invariant()
    def tree_is_a_compressed_radix_tree(self):
        tree = self.cache._tree
        assert set(tree.end) == set(self.tokens) == tree.root.seqs
        stack = [tree.root]
        while stack:
            node = stack.pop()
            below = set(node.ends)
            for first, child in node.children.items():
                assert child.parent is node and child.edge and child.edge[0] == first
                assert child.depth == node.depth + len(child.edge)
                below |= child.seqs
                stack.append(child)
            assert node.seqs == below
            if node is not tree.root:
                assert node.ends or len(node.children) >= 2
            for seq_id in node.ends:
                assert tree.end[seq_id] is node


TestPrefixCacheMachine = PrefixCacheMachine.TestCase
TestPrefixCacheMachine.settings = settings(max_examples=150, stateful_step_count=30,
                                           deadline=None)
