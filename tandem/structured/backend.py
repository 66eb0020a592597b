"""The interface a grammar library implements for tandem (llguidance_backend.py ships one).

A backend compiles a StructuredOutput once (compiled grammars are cached by content) and makes
matchers of it. A matcher holds one sequence's token state only: the tokens it consumed. Its
contract, as the target uses it: `validate` before `consume` (a token consumed in error leaves a
library's matcher broken for good), `rollback` the last n consumed tokens, `fill_bitmask` the
allowed next tokens (bit t of word t // 32 set: token t allowed).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from tandem.structured.spec import StructuredOutput


class Matcher(Protocol):
    def validate(self, tokens: Sequence[int]) -> int:
        """How many of `tokens`, in order, the grammar accepts from here (consumes none)."""

    def consume(self, tokens: Sequence[int]) -> None:
        """Advance over tokens `validate` accepted."""

    def rollback(self, count: int) -> None:
        """Undo the last `count` consumed tokens."""

    def is_stopped(self) -> bool:
        """Nothing but EOS may follow (the grammar is complete and cannot grow)."""

    def fill_bitmask(self, address: int, num_bytes: int) -> None:
        """Write the allowed next tokens as int32 words at `address` (ceil(vocab / 32) words)."""


class ForcingMatcher(Matcher, Protocol):
    """A matcher that also names the tokens its grammar forces (the draft proposes them free)."""

    def forced_tokens(self) -> list[int]:
        """The canonical tokens of the bytes the grammar forces from here ([] if none)."""


class Grammar(Protocol):
    """A compiled spec; opaque to callers."""


class GrammarBackend(Protocol):
    vocab_size: int  # the model's, padding included: the bitmask's bits
    eos_token_ids: frozenset[int]

    def compile(self, spec: StructuredOutput) -> Grammar:
        """Raise InvalidArgument naming spec.field with the compiler's message."""

    def new_matcher(self, grammar: Grammar) -> Matcher:
        """A matcher at the grammar's start."""
