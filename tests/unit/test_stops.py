"""StopStringMatcher: stop strings split across deltas are caught and never streamed."""

from __future__ import annotations

import tracemalloc

from hypothesis import given, settings
from hypothesis import strategies as st

from router.stops import StopStringMatcher


def run(stop: list[str], deltas: list[str]) -> tuple[list[str], bool]:
    """Push every delta (until stopped); returns the streamed pieces and whether it stopped."""
    matcher = StopStringMatcher(stop)
    pieces = []
    for delta in deltas:
        out, stopped = matcher.push(delta)
        pieces.append(out)
        if stopped:
            return pieces, True
    pieces.append(matcher.flush())
    return pieces, False


def reference(text: str, stop: list[str]) -> str:
    """Text before the stop string that completes first (the longest, if several end there)."""
    for end in range(1, len(text) + 1):
        ending = [s for s in stop if s and text.endswith(s, 0, end)]
        if ending:
            return text[: end - max(map(len, ending))]
    return text


def test_stop_split_across_three_deltas():
    pieces, stopped = run(["<|user|>"], ["Hello <|u", "se", "r|> more"])
    assert stopped
    assert pieces == ["Hello ", "", ""]


def test_held_text_is_released_when_the_match_fails():
    matcher = StopStringMatcher(["STOP"])
    assert matcher.push("go ST") == ("go ", False)
    assert matcher.push("O") == ("", False)
    assert matcher.push("P!") == ("", True)
    matcher = StopStringMatcher(["STOP"])
    assert matcher.push("go ST") == ("go ", False)
    assert matcher.push("OW") == ("STOW", False)  # no false hold forever
    assert matcher.flush() == ""


def test_overlapping_candidate_prefixes():
    # "aab" must be found although "aa" first looked like the start of the match.
    pieces, stopped = run(["aab"], ["a", "a", "a", "b", "c"])
    assert stopped
    assert "".join(pieces) == "a"
    pieces, stopped = run(["abab"], ["ab", "ab", "ab"])
    assert stopped and "".join(pieces) == ""
    pieces, stopped = run(["abac"], ["ab", "ab", "ac"])
    assert stopped and "".join(pieces) == "ab"


def test_multiple_stop_strings_earliest_wins():
    pieces, stopped = run(["world", "lo w"], ["hello world"])
    assert stopped and pieces == ["hel"]
    pieces, stopped = run(["\n\n", "END"], ["one END two\n\nthree"])
    assert stopped and pieces == ["one "]


def test_stop_that_completes_first_wins_over_one_that_starts_first():
    # As text streams, "bc" is complete before "abcd" could be: generation stops there.
    assert run(["abcd", "bc"], ["abcd"]) == (["a"], True)
    assert run(["abcd", "bc"], ["a", "b", "c", "d"]) == (["", "", "a"], True)
    # Two stops ending at the same character: the longer one is cut.
    assert run(["bc", "abc"], ["xabc"]) == (["x"], True)


def test_stop_at_the_very_start():
    assert run(["###"], ["###", "rest"]) == ([""], True)
    assert run(["###"], ["#", "#", "#"]) == (["", "", ""], True)


def test_done_after_stop():
    matcher = StopStringMatcher(["."])
    assert matcher.push("a. b") == ("a", True)
    assert matcher.stopped
    assert matcher.push("more") == ("", True)
    assert matcher.flush() == ""


def test_no_stop_strings_passes_text_through():
    matcher = StopStringMatcher([])
    assert matcher.push("any <|text|>") == ("any <|text|>", False)
    assert matcher.flush() == ""
    assert StopStringMatcher([""]).push("x") == ("x", False)  # empty stop strings ignored


def test_flush_returns_held_text():
    matcher = StopStringMatcher(["</s>"])
    assert matcher.push("end </") == ("end ", False)
    assert matcher.flush() == "</"
    assert matcher.flush() == ""


def test_multibyte_characters():
    assert run(["世界"], ["héllo 世", "界 🙂"]) == (["héllo ", ""], True)


@st.composite
def chunked_text(draw):
    text = draw(st.text(alphabet="abc\n", max_size=40))
    cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=10)))
    bounds = [0, *cuts, len(text)]
    return text, [text[a:b] for a, b in zip(bounds, bounds[1:])]


@settings(max_examples=300, deadline=None)
@given(
    text_and_deltas=chunked_text(),
    stop=st.lists(st.text(alphabet="abc\n", min_size=1, max_size=4), max_size=3),
)
def test_random_chunks_equal_truncation_before_first_stop(text_and_deltas, stop):
    text, deltas = text_and_deltas
    pieces, stopped = run(stop, deltas)
    expected = reference(text, stop)
    assert "".join(pieces) == expected
    assert stopped == any(s in text for s in stop)


def held_reference(text: str, stop: list[str]) -> int:
    """Length of the longest suffix of text that is a proper prefix of a stop string."""
    return max((k for s in stop for k in range(1, len(s)) if text.endswith(s[:k])), default=0)


@settings(max_examples=300, deadline=None)
@given(
    text_and_deltas=chunked_text(),
    stop=st.lists(st.text(alphabet="abc\n", min_size=1, max_size=5), max_size=3),
)
def test_only_a_possible_start_of_a_stop_is_held(text_and_deltas, stop):
    """After each delta that completes no stop string, everything streams but the longest tail
    that could still begin one: nothing is held that cannot become a stop string."""
    _, deltas = text_and_deltas
    matcher, seen, streamed = StopStringMatcher(stop), "", ""
    for delta in deltas:
        out, stopped = matcher.push(delta)
        if stopped:
            return
        seen, streamed = seen + delta, streamed + out
        assert streamed == seen[: len(seen) - held_reference(seen, stop)]


def test_a_long_stop_string_costs_linear_memory():
    stop = "ab" * 25_000 + "c"  # a set of its prefixes would hold 50k strings, 1.25 GB
    tracemalloc.start()
    try:
        matcher = StopStringMatcher([stop])
        assert tracemalloc.get_traced_memory()[1] < 20 * 2**20
    finally:
        tracemalloc.stop()
    assert matcher.push("ab" * 25_000) == ("", False)  # all of it may still begin the stop string
    assert matcher.push("x") == ("ab" * 25_000 + "x", False)
    assert matcher.push(stop[:-1]) == ("", False)
    assert matcher.push("c and more") == ("", True)
