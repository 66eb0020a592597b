"""Suffix drafting's counts against a brute-force search, the recent outputs' bound, and the
proposal tree's shape: best first, parents before children, siblings distinct, scores floored."""

import random
from collections import Counter

import pytest

from router.suffix import ContextCounts, RecentOutputs, propose_tree


def brute_longest(stream: list[int], query: list[int], max_depth: int) -> Counter | None:
    for m in range(min(max_depth, len(query)), 0, -1):
        context = query[len(query) - m :]
        found = Counter(stream[i] for i in range(m, len(stream)) if stream[i - m : i] == context)
        if found:
            return found
    return None


@pytest.mark.parametrize("seed", range(10))
def test_the_longest_context_s_followers_match_a_brute_force_count(seed):
    rng = random.Random(seed)
    depth = rng.randint(1, 4)
    counts, stream = ContextCounts(depth), []
    for _ in range(40):
        chunk = [rng.randrange(5) for _ in range(rng.randint(1, 4))]
        start = len(stream)
        stream += chunk
        counts.add(stream, start)
        query = stream[-rng.randint(1, 6):]
        assert counts.longest(query) == brute_longest(stream, query, depth)


def test_recent_outputs_keep_their_bound_and_forget_the_oldest():
    recent = RecentOutputs(max_depth=3, max_tokens=10)
    recent.add([1, 2, 3, 4, 5, 6])
    recent.add([7, 8, 9, 7, 8])
    assert recent.counts.longest([1, 2]) is None  # the first output went to keep 10 tokens
    assert recent.counts.longest([7, 8]) == Counter({9: 1})
    fresh = ContextCounts(3)
    fresh.add([7, 8, 9, 7, 8])
    assert recent.counts.followers == fresh.followers  # forgetting left no trace


def test_a_repeating_stream_proposes_its_continuation_as_a_chain():
    counts = ContextCounts(4)
    stream = [1, 2, 3, 4] * 3 + [1, 2]
    counts.add(stream)
    tokens, parents = propose_tree(stream, [counts], budget=5, min_score=0.5)
    assert tokens == (3, 4, 1, 2, 3) and parents == (0, 1, 2, 3, 4)


def test_a_context_followed_by_two_tokens_branches_and_the_floor_cuts_it():
    counts = ContextCounts(2)
    stream = [9, 1, 2, 3, 9, 1, 2, 4, 9, 1, 2]
    counts.add(stream)
    tokens, parents = propose_tree(stream, [counts], budget=8, min_score=0.3)
    assert sorted(tokens[:2]) == [3, 4] and parents[:2] == (0, 0)  # two children of the root, 0.5 each
    for i, p in enumerate(parents):
        assert 0 <= p <= i
        assert len({(q, t) for q, t in zip(parents, tokens)}) == len(tokens)  # siblings differ
    assert propose_tree(stream, [counts], budget=8, min_score=0.6) == ((), ())  # 0.5 < 0.6: nothing


def test_other_requests_outputs_are_merged_in():
    own, recent = ContextCounts(3), RecentOutputs(3, 100)
    own.add([5, 6])
    recent.add([5, 6, 7, 8])
    tokens, _ = propose_tree([5, 6], [own, recent.counts], budget=2, min_score=0.5)
    assert tokens == (7, 8)
