"""One sequence's grammar state: a matcher and the output tokens it stands after.

The target keeps one per constrained sequence and brings it to the sequence's output before each
sampled step (`sync`): it rolls back to the common prefix and consumes the rest, so a matcher is
rebuilt from nothing, or moved, whatever happened to the sequence (new, forked, preempted and
resumed, popped, a restarted target). Tokens are validated before they are consumed: a draft
outside the grammar is refused, never fed (it would break the matcher for good). EOS after the
grammar stopped is recorded but not fed (llguidance would not count it in a rollback).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from tandem.structured.backend import Matcher

log = logging.getLogger(__name__)


class SequenceGrammar:
    def __init__(self, matcher: Matcher, eos_token_ids: frozenset[int]):
        self.matcher = matcher
        self.eos_token_ids = eos_token_ids
        self.history: list[int] = []  # the output tokens it stands after
        self._fed = 0  # history[:_fed] went into the matcher; the rest are EOS after it stopped

    def accept(self, token_id: int) -> bool:
        """Advance over one token if the grammar allows it; False (and no change) if not."""
        if self.matcher.is_stopped():
            if token_id not in self.eos_token_ids:
                return False
        elif self.matcher.validate((token_id,)) == 1:
            self.matcher.consume((token_id,))
            self._fed += 1
        else:
            return False
        self.history.append(token_id)
        return True

    def rollback_to(self, length: int) -> None:
        """Stand after the first `length` tokens of the history."""
        assert 0 <= length <= len(self.history)
        if length < self._fed:
            self.matcher.rollback(self._fed - length)
            self._fed = length
        del self.history[length:]

    def sync(self, output: Sequence[int]) -> bool:
        """Stand after `output`; False when a token of it is outside the grammar (the state then
        stands after the longest valid prefix)."""
        common = 0
        for mine, theirs in zip(self.history, output):
            if mine != theirs:
                break
            common += 1
        self.rollback_to(common)
        for i in range(common, len(output)):
            if not self.accept(output[i]):
                log.warning("output token %d at %d is outside the grammar", output[i], i)
                return False
        return True
