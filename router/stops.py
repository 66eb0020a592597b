"""Stop strings over streamed text (OpenAI semantics: the stop string itself is not returned).

Text arrives in deltas, and a stop string may be split across them ("<|us" + "er|>"). The
matcher therefore keeps back the *held* text: the longest suffix of what it has seen that is
a proper prefix of some stop string, since the next delta may complete it. Everything before
the held text can never be part of a match and streams at once.

The first occurrence is the one that is complete first, as text streams in; among stop
strings that complete at the same character, the one that starts earliest. Generation stops
there, so the output does not depend on how the text was split into deltas.

Each stop string runs a Knuth-Morris-Pratt automaton over the characters as they stream: its
state is the longest prefix of that stop string the text ends with, so the held text is as long
as the largest state, and memory and time are linear in the stop strings' length (a set of every
prefix would be quadratic: a client's 50k-character stop string, gigabytes).
"""

from __future__ import annotations

from collections.abc import Sequence


class StopStringMatcher:
    """Streams text up to the first stop string of one sequence; done once it is found."""

    def __init__(self, stop: Sequence[str]) -> None:
        # An empty stop string would match before any text: it means nothing, drop it.
        self._stops = tuple(s for s in dict.fromkeys(stop) if s)
        self._failure = [failure_function(s) for s in self._stops]
        self._states = [0] * len(self._stops)  # per stop: length of its prefix the text ends with
        self._firsts = frozenset(s[0] for s in self._stops)
        self._matching = False  # some state is past 0: the automata must step
        self._pending = ""  # seen, not yet returned: the held text
        self._stopped = False

    @property
    def stopped(self) -> bool:
        return self._stopped

    def push(self, text: str) -> tuple[str, bool]:
        """Add a delta; return (text safe to stream now, whether a stop string was found).

        Once stopped, every later push returns ("", True).
        """
        if self._stopped:
            return "", True
        if not self._stops:
            return text, False
        pending = self._pending + text
        for end, char in enumerate(text, start=len(self._pending) + 1):
            if not self._matching and char not in self._firsts:
                continue  # every automaton stays at 0: the common case costs a set lookup
            longest = self._step(char)
            if longest:  # stops that complete here; the longest starts earliest
                self._pending, self._stopped = "", True
                return pending[: end - longest], True
        held = max(self._states)
        self._pending = pending[len(pending) - held :]
        return pending[: len(pending) - held], False

    def flush(self) -> str:
        """Return the held text when generation ends for another reason ("" once stopped)."""
        out, self._pending = self._pending, ""
        return "" if self._stopped else out

    def _step(self, char: str) -> int:
        """Advance every automaton by one character; the length of the longest stop string
        that completes at it (0: none)."""
        longest = 0
        for k, (stop, failure) in enumerate(zip(self._stops, self._failure)):
            state = self._states[k]
            while state and stop[state] != char:
                state = failure[state - 1]
            if stop[state] == char:
                state += 1
            if state == len(stop):
                longest = max(longest, state)
            self._states[k] = state
        self._matching = any(self._states)
        return longest


def failure_function(s: str) -> list[int]:
    """failure[i]: the length of the longest proper prefix of s[: i + 1] that is also its suffix."""
    failure, k = [0] * len(s), 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = failure[k - 1]
        if s[i] == s[k]:
            k += 1
        failure[i] = k
    return failure
