"""Prompt lookup: the proposal is what followed the latest earlier occurrence of the longest
matching suffix, checked against a brute-force search over random token streams."""

import random

import pytest

from router.ngram import NgramIndex


def brute_force(tokens: list[int], min_n: int, max_n: int, k: int) -> tuple[int, ...]:
    end = len(tokens) - 1
    for n in range(min(max_n, end), min_n - 1, -1):
        suffix = tokens[end - n + 1 :]
        for start in range(end - n, -1, -1):  # latest earlier occurrence first
            if tokens[start : start + n] == suffix:
                return tuple(tokens[start + n : start + n + k])
    return ()


def test_it_proposes_what_followed_the_repeated_suffix():
    index = NgramIndex(2, 3)
    index.extend([5, 6, 7, 8, 9, 1, 6, 7])
    assert index.propose(3) == (8, 9, 1)
    index.extend([8])  # 6 7 8 occurred before: what followed it, the longest n first
    assert index.propose(2) == (9, 1)


def test_nothing_is_proposed_without_an_earlier_occurrence():
    index = NgramIndex(2, 4)
    index.extend([1, 2, 3, 4])
    assert index.propose(4) == ()
    index.extend([1])  # a 1-gram repeats, but min_n is 2
    assert index.propose(4) == ()


def test_the_latest_occurrence_wins():
    index = NgramIndex(1, 1)
    index.extend([3, 10, 3, 11, 3])
    assert index.propose(1) == (11,)


@pytest.mark.parametrize("seed", range(20))
def test_it_matches_a_brute_force_search_as_tokens_come(seed):
    rng = random.Random(seed)
    min_n = rng.randint(1, 3)
    max_n = rng.randint(min_n, 5)
    index, tokens = NgramIndex(min_n, max_n), []
    for _ in range(300):
        chunk = [rng.randrange(6) for _ in range(rng.randint(1, 3))]  # a small vocabulary repeats
        index.extend(chunk)
        tokens += chunk
        k = rng.randint(1, 6)
        assert index.propose(k) == brute_force(tokens, min_n, max_n, k)


def test_sizes_must_be_ordered():
    with pytest.raises(ValueError):
        NgramIndex(3, 2)
