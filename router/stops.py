"""Stop strings over streamed text (OpenAI semantics: the stop string itself is not returned).

Text arrives in deltas, and a stop string may be split across them ("<|us" + "er|>"). The
matcher therefore keeps back the *held* text: the longest suffix of what it has seen that is
a proper prefix of some stop string, since the next delta may complete it. Everything before
the held text can never be part of a match and streams at once.

The first occurrence is the one that is complete first, as text streams in; among stop
strings that complete at the same character, the one that starts earliest. Generation stops
there, so the output does not depend on how the text was split into deltas.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopStringMatcher:
    """Streams text up to the first stop string of one sequence; done once it is found."""

    def __init__(self, stop: Sequence[str]) -> None:
        # An empty stop string would match before any text: it means nothing, drop it.
        self._stops = tuple(s for s in dict.fromkeys(stop) if s)
        self._prefixes = {s[:k] for s in self._stops for k in range(1, len(s))}
        self._max_held = max((len(s) - 1 for s in self._stops), default=0)
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
        cut = self._first_stop(pending)
        if cut is not None:
            self._pending = ""
            self._stopped = True
            return pending[:cut], True
        held = self._held_length(pending)
        self._pending = pending[len(pending) - held :]
        return pending[: len(pending) - held], False

    def flush(self) -> str:
        """Return the held text when generation ends for another reason ("" once stopped)."""
        out, self._pending = self._pending, ""
        return "" if self._stopped else out

    def _first_stop(self, pending: str) -> int | None:
        """Start of the stop string that completes first in `pending`, or None."""
        best: tuple[int, int] | None = None  # (end, start)
        for s in self._stops:
            start = pending.find(s)
            if start >= 0:
                candidate = (start + len(s), start)
                best = candidate if best is None else min(best, candidate)
        return None if best is None else best[1]

    def _held_length(self, pending: str) -> int:
        """Length of the longest suffix of `pending` that is a proper prefix of a stop."""
        for k in range(min(len(pending), self._max_held), 0, -1):
            if pending[-k:] in self._prefixes:
                return k
        return 0
