"""What a draft needs of a sequence's grammar (the draft's side; torch): where its drafts stand,
the allowed tokens there, and the tokens the grammar forces.

A DraftWalk holds one sequence's SequenceGrammar for one draft call: it starts after the
sequence's output, advances over the tokens the draft proposes (validated first, as the target
does: a token consumed in error would break the matcher for good) and rolls back to where it
started when the call ends. A forced run is what llguidance's `compute_ff_tokens` gives: the
canonical tokens of the bytes the grammar allows alone from here (after `{"name` of a schema with
fixed keys, `":`), each checked with the matcher before it is proposed.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from tandem.structured.masks import fill_row, new_bitmask, unpack
from tandem.structured.matcher import SequenceGrammar


class DraftWalk:
    """One sequence's grammar during one draft call (see the module doc)."""

    def __init__(self, grammar: SequenceGrammar, vocab_size: int):
        self.grammar, self.vocab_size = grammar, vocab_size
        self.base = len(grammar.history)  # the output's length: the walk's start

    @property
    def stopped(self) -> bool:
        """Nothing but EOS may follow: nothing worth drafting."""
        return self.grammar.matcher.is_stopped()

    def push(self, token_id: int) -> bool:
        """Advance over a proposed token; False (no change) if the grammar refuses it."""
        return self.grammar.accept(token_id)

    def to(self, path: Sequence[int]) -> bool:
        """Stand after the output and then `path` (a tree node's tokens below the root)."""
        self.grammar.rollback_to(self.base)
        return all(self.grammar.accept(t) for t in path)

    def allowed(self) -> Tensor:
        """[V] bool: the tokens the grammar allows next."""
        bitmask = new_bitmask(1, self.vocab_size)
        fill_row(self.grammar, bitmask, 0)
        return unpack(bitmask, self.vocab_size)[0]

    def forced(self, limit: int) -> list[int]:
        """Up to `limit` tokens the grammar forces from here, advanced over; [] if none."""
        if limit <= 0 or self.stopped:
            return []
        run = []
        for token in self.grammar.matcher.forced_tokens()[:limit]:
            if not self.push(token):
                break
            run.append(token)
        return run

    def close(self) -> None:
        self.grammar.rollback_to(self.base)


def masked(logits: Tensor, allowed: Tensor) -> Tensor:
    """logits [..., V] with -inf where `allowed` [..., V] is False (a new tensor)."""
    return logits.masked_fill(~allowed.to(logits.device), float("-inf"))


def has_allowed(logits: Tensor) -> bool:
    """Whether a masked row [V] keeps a token (a pruned draft vocabulary may hold none of the
    allowed ones)."""
    return bool(torch.isfinite(logits).any())


def point_mass(token_id: int, vocab_size: int, dtype: torch.dtype, device=None) -> Tensor:
    """[V]: the proposal of a token proposed for sure (a forced one): verification accepts it with
    the target's masked probability p'(t), else draws from p' without t; exact."""
    row = torch.zeros(vocab_size, dtype=dtype, device=device)
    row[token_id] = 1.0
    return row


def first_allowed(allowed: Tensor) -> int:
    """The lowest allowed token id (a tree node whose draft vocabulary holds no allowed token
    still needs a child; it gets this one, scored -inf, as a point mass)."""
    return int(allowed.nonzero()[0, 0])
