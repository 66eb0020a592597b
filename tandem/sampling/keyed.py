"""Position-keyed draws: how a seeded request samples (pure tensor code).

A seeded sampled sequence (`SamplingParams.keyed`) draws the token at index i of its sequence
with noise that depends only on (seed, i, token id), never on how much of a random stream the
steps before it consumed. Its output is then a function of the seed and the target's logits
alone: the same whether a step decoded plainly or verified drafts (accepted or not), whether the
batch paused speculation, trimmed or denied the drafts, or preempted and resumed the sequence.
A stream-consuming sampler cannot promise that: speculative sampling draws one number per draft
tried and a plain step one in all.

The draw is the exponential race, argmax_x p(x) / E_x with E_x ~ Exp(1) independent per token:
exactly a draw from p (the Gumbel-max trick), computed as argmax log p(x) - log E_x from the
tempered logits over p's support, so that it does not depend on how p was normalised. E_x =
-log u_x, u_x from splitmix64 over (seed, index, x): counter-based, the same on every device and
in any batch. Equal logits give equal tokens, as for greedy decoding: kernels whose results move
with the batch's shape (a verify of k + 1 rows against a decode of one, bf16 on GPUs) can move a
near tie, as they can move a greedy argmax.

Verifying drafts of such a sequence is greedy over the keyed choice (verify.py, tree_verify.py):
a draft is kept when it equals the token the target draws at its index, and the first one that
does not is replaced by that token. Every emitted token is the target's own keyed draw, so the
output equals plain decoding's token for token; acceptance is P(draft = that draw) instead of
speculative sampling's sum(min(p, q)).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

_U64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15  # splitmix64's increment (the golden ratio's 64-bit fraction)
_MUL1, _MUL2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def _signed(x: int) -> int:
    """A uint64 as the int64 with the same bits (torch has no uint64 arithmetic)."""
    return x - (1 << 64) if x >> 63 else x


def _mix_int(x: int) -> int:
    """splitmix64's finalizer on a Python int (mod 2**64)."""
    x &= _U64
    x = ((x ^ (x >> 30)) * _MUL1) & _U64
    x = ((x ^ (x >> 27)) * _MUL2) & _U64
    return x ^ (x >> 31)


def _mix(x: Tensor) -> Tensor:
    """The same finalizer on int64 tensors: products wrap mod 2**64 as uint64's do; the right
    shifts are made logical by masking off the sign bits an arithmetic shift copies in."""
    x = x ^ ((x >> 30) & ((1 << 34) - 1))
    x = x * _signed(_MUL1)
    x = x ^ ((x >> 27) & ((1 << 37) - 1))
    x = x * _signed(_MUL2)
    return x ^ ((x >> 31) & ((1 << 33) - 1))


def row_key(seed: int, index: int) -> int:
    """The key of token index `index` of a sequence seeded `seed` (an int64's bits)."""
    return _signed(_mix_int(seed + _GAMMA * (index + 1)))


def _uniforms(keys: Tensor, vocab_size: int) -> Tensor:
    """u [R, V] float64 in (0, 1): row r's token x is splitmix64 of keys[r] + x * gamma."""
    ids = torch.arange(vocab_size, dtype=torch.int64, device=keys.device) * _signed(_GAMMA)
    x = _mix(ids[None, :] + keys[:, None])
    return ((x >> 11) & ((1 << 53) - 1)).to(torch.float64).add_(0.5).mul_(2.0**-53)


def keyed_draw(logits: Tensor, support: Tensor, seeds: Sequence[int], indices: Sequence[int]) -> Tensor:
    """One token per row: row r is the draw at token index `indices[r]` of the sequence seeded
    `seeds[r]`, argmax over the support of logits - log E. logits [R, V]: the tempered logits,
    log p up to a constant per row (so the draw does not depend on which softmax normalised p,
    which a batch's other rows may choose); support [R, V] bool: the tokens p keeps (top-k,
    top-p, min-p). Returns [R] int64 token ids."""
    assert logits.shape == support.shape and logits.shape[0] == len(seeds) == len(indices)
    if not bool(support.any(dim=-1).all()):
        raise ValueError("keyed_draw: a row keeps no token")
    keys = torch.tensor([row_key(s, i) for s, i in zip(seeds, indices, strict=True)], device=logits.device)
    scores = logits.double() - _uniforms(keys, logits.shape[1]).log_().neg_().log_()
    return scores.masked_fill_(~support, float("-inf")).argmax(dim=-1)


def keyed_token(processed: Tensor, probs: Tensor, params, index: int) -> int:
    """The keyed draw of one row: processed [V] logits (sampler.process_logits), probs [V] the
    distribution `probabilities` made of them (its support), params the sequence's."""
    tempered = (processed / params.temperature)[None]
    return int(keyed_draw(tempered, (probs > 0)[None], [params.seed], [index])[0])
