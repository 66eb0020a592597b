"""Lossless verification of one sequence's draft chain (speculative sampling, pure tensor code).

Words (as in vLLM v1's rejection sampler):
- draft tokens: the k tokens d_1..d_k the draft proposed after the last accepted token, each
  sampled from the draft's proposal distribution q_j (row j - 1 of `draft_probs`).
- target distribution p_j: what the target alone would sample from at row j,
  `probabilities(process_logits(row j))`, with the drafts accepted so far (d_1..d_j) counted as
  outputs by the penalties.
- accepted tokens: the longest prefix of the drafts the target keeps. Greedy: d_{j+1} equals the
  argmax of row j. Sampling: d_{j+1} passes the test u < min(1, p_j(d) / q_j(d)), u ~ U[0, 1).
- recovered token: emitted at the first rejected position j instead of d_{j+1}. Greedy: the argmax
  of row j. Sampling: drawn from norm(max(p_j - q_j, 0)) (from p_j where that residual is zero).
- bonus token: emitted after all k drafts were accepted, from row k (argmax, or drawn from p_k).
- keyed (a seeded request, `params.keyed`): greedy over the keyed draw of each row instead of its
  argmax (tandem.sampling.keyed): the output equals plain decoding's; no proposal is needed.
Every step emits `num_accepted + 1` tokens: the accepted drafts, then one recovered or bonus
token, and together they are distributed exactly as if the target had sampled them one by one.
Logprobs are raw: log_softmax of the raw target logits (as in `sample`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from tandem.sampling.keyed import keyed_token
from tandem.sampling.sampler import draw, masked, probabilities, process_logits
from tandem.sampling.state import SamplingState


@dataclass(frozen=True, slots=True)
class VerifiedToken:
    """One emitted token, its raw logprob and the top raw logprobs of its row (highest first)."""

    token_id: int
    logprob: float  # raw log_softmax of the target logits at that position
    top: tuple[tuple[int, float], ...]  # top-k raw logprobs, k = params.top_logprobs (empty if 0)


@dataclass(frozen=True, slots=True)
class VerifyResult:
    """The outcome of one verify step of one sequence."""

    num_accepted: int  # draft tokens accepted, 0..k
    tokens: tuple[VerifiedToken, ...]  # accepted drafts + one recovered or bonus token


def verify_chain(
    target_logits: Tensor,
    draft_tokens: Sequence[int],
    draft_probs: Tensor | None,
    state: SamplingState,
    first_index: int = 0,
    allowed: Tensor | None = None,
) -> VerifyResult:
    """Accept a prefix of the draft chain, emit one recovered or bonus token, record all outputs.

    target_logits: [k + 1, V] raw target logits, any float dtype; row j scores the token after
        input j (row 0 follows the last accepted token, row j >= 1 follows draft j).
    draft_tokens: the k draft token ids d_1..d_k.
    draft_probs: [k, V] the proposal distribution q each draft token was sampled from (row j - 1
        for d_j); None for greedy and keyed states. A sampled state without it verifies the
        drafts as point masses (chosen deterministically: accept d with probability p(d), else
        draw from p without d), exact for any drafts, as tree_verify's rule for top-k children.
    state: the sequence's sampling state. Its generator is consumed (sampling only); every
        emitted token is recorded with `observe_output`, in order.
    first_index: the index in its sequence of the token row 0 scores (keyed states).
    allowed: [k + 1, V] bool, the grammar's mask of each row (None: none): every rule above then
        runs on p' = p masked and renormalised (`sampler.masked`), so a draft outside the grammar
        has p'(d) = 0 and is rejected, the residual and the bonus come from p'. Exact for any q.
        Logprobs stay raw.
    """
    k = len(draft_tokens)
    vocab_size = state.vocab_size
    assert target_logits.dim() == 2 and tuple(target_logits.shape) == (k + 1, vocab_size)
    assert all(0 <= d < vocab_size for d in draft_tokens)
    assert draft_probs is None or tuple(draft_probs.shape) == (k, vocab_size)
    if not (state.params.greedy or state.params.keyed) and draft_probs is None and k:
        draft_probs = torch.nn.functional.one_hot(torch.tensor(list(draft_tokens)), vocab_size).float()
    rows = _TargetRows(masked(target_logits, allowed)[: len(draft_tokens) + 1], state)
    if state.params.greedy:
        num_accepted, last = _verify_greedy(draft_tokens, lambda j: int(rows.processed(j).argmax()), rows.accept)
    elif state.params.keyed:
        keyed = lambda j: keyed_token(rows.processed(j), rows.probs(j), state.params, first_index + j)  # noqa: E731
        num_accepted, last = _verify_greedy(draft_tokens, keyed, rows.accept)
    else:
        num_accepted, last = _verify_sampled(rows, draft_tokens, draft_probs, state.generator)
    emitted = [*(int(d) for d in draft_tokens[:num_accepted]), last]
    for token_id in emitted:
        state.observe_output(token_id)
    tokens = _verified_tokens(target_logits[: len(emitted)], emitted, state.params.top_logprobs)
    return VerifyResult(num_accepted=num_accepted, tokens=tokens)


class _TargetRows:
    """The processed logits and target distributions p_j of one chain's rows.

    Without penalties every row is processed in one batched call. With penalties row j depends on
    the drafts accepted before it, so rows are processed one at a time against a scratch copy of
    the bookkeeping, which `accept` advances; the caller's state is never touched.
    """

    def __init__(self, target_logits: Tensor, state: SamplingState) -> None:
        # target_logits: [n, V] raw logits of the rows that may be reached.
        self._logits = target_logits
        self._state = state
        self._scratch: SamplingState | None = None
        self._processed: Tensor | None = None  # [n, V] float32, batched path only
        self._probs: Tensor | None = None  # [n, V] float32, batched path only
        if state.needs_penalties:
            assert state.seen is not None and state.output_counts is not None
            self._scratch = copy.copy(state)  # shares the generator, never its bookkeeping
            self._scratch.seen = state.seen.clone()
            self._scratch.output_counts = state.output_counts.clone()
        else:
            self._processed = process_logits(target_logits, [state] * target_logits.shape[0])

    def processed(self, j: int) -> Tensor:
        """[V] float32 processed logits of row j."""
        if self._processed is not None:
            return self._processed[j]
        assert self._scratch is not None
        return process_logits(self._logits[j : j + 1], [self._scratch])[0]

    def probs(self, j: int) -> Tensor:
        """[V] float32 target distribution p_j of row j."""
        if self._scratch is not None:
            return probabilities(self.processed(j)[None], [self._scratch])[0]
        if self._probs is None:
            assert self._processed is not None
            states = [self._state] * self._processed.shape[0]
            self._probs = probabilities(self._processed, states)
        return self._probs[j]

    def accept(self, token_id: int) -> None:
        """Count an accepted draft as an output for the rows after it."""
        if self._scratch is not None:
            self._scratch.observe_output(token_id)


def _verify_greedy(draft_tokens: Sequence[int], choose: Callable[[int], int],
                   accept: Callable[[int], None]) -> tuple[int, int]:
    """Returns (num_accepted, the recovered or bonus token): drafts are kept while each equals
    `choose(j)`, the target's own token of row j (its argmax, or its keyed draw)."""
    for j, d in enumerate(draft_tokens):
        best = choose(j)
        if d != best:
            return j, best  # recovered
        accept(d)
    return len(draft_tokens), choose(len(draft_tokens))  # bonus


def _verify_sampled(
    rows: _TargetRows,
    draft_tokens: Sequence[int],
    draft_probs: Tensor | None,
    generator: torch.Generator,
) -> tuple[int, int]:
    """Returns (num_accepted, the recovered or bonus token), drawing from `generator`.

    draft_probs: [k, V] proposal distributions q_j; None only when there are no drafts.
    """
    for j, d in enumerate(draft_tokens):
        assert draft_probs is not None
        p = rows.probs(j)  # [V]
        q = draft_probs[j].to(device=p.device, dtype=torch.float32)  # [V]
        p_d, q_d = float(p[d]), float(q[d])
        assert q_d > 0, f"draft token {d} at position {j + 1} has draft probability 0"
        u = float(torch.rand(1, generator=generator, device=generator.device))
        # Accept d with probability min(1, p(d) / q(d)): where the target likes d at least as much
        # as the draft, keep it; elsewhere keep it only in proportion p / q. On rejection sample
        # from norm(max(p - q, 0)), the mass the draft under-proposed: the total is exactly p.
        if u * q_d < p_d:
            rows.accept(d)
            continue
        residual = (p - q).clamp_min_(0.0)
        total = float(residual.sum())
        residual = residual / total if total > 0 else p  # p == q numerically: draw from p
        return j, int(draw(residual[None], [generator])[0])  # recovered
    bonus = draw(rows.probs(len(draft_tokens))[None], [generator])[0]
    return len(draft_tokens), int(bonus)


def fits_chain(draft_probs: Tensor, draft_tokens: Sequence[int]) -> bool:
    """Whether draft_probs [k, V] can verify the chain: proper rows (`proper_proposal`), row j
    giving draft j + 1 positive probability. A row that does not (a faulty draft) must not reach
    `_verify_sampled`'s assert."""
    if draft_probs.dim() != 2 or draft_probs.shape[0] != len(draft_tokens):
        return False
    rows = draft_probs.float()
    return proper_proposal(rows, rows[torch.arange(len(draft_tokens)), torch.tensor(draft_tokens, dtype=torch.long)])


def proper_proposal(rows: Tensor, at_drafts: Tensor) -> bool:
    """rows [n, V] float32 are finite, non-negative and sum to 1, and every draft has positive
    probability (at_drafts: each draft's entry in its row)."""
    return (bool(torch.isfinite(rows).all()) and float(rows.min()) >= 0
            and float((rows.sum(dim=-1) - 1).abs().max()) <= 1e-3 and float(at_drafts.min()) > 0)


def _verified_tokens(
    target_logits: Tensor, emitted: Sequence[int], top_logprobs: int
) -> tuple[VerifiedToken, ...]:
    """target_logits: [n, V] raw logits of the rows that emitted `emitted` (n tokens)."""
    assert target_logits.shape[0] == len(emitted)
    raw = torch.log_softmax(target_logits.float(), dim=-1)  # [n, V]
    ids = torch.tensor(emitted, dtype=torch.long, device=raw.device)
    chosen = raw.gather(1, ids[:, None]).squeeze(1).tolist()  # [n]
    top: list[tuple[tuple[int, float], ...]] = [() for _ in emitted]
    n_top = min(top_logprobs, raw.shape[1])
    if n_top > 0:
        values, top_ids = raw.topk(n_top, dim=-1, sorted=True)
        top = [
            tuple(zip(row_ids, row_values, strict=True))
            for row_ids, row_values in zip(top_ids.tolist(), values.tolist(), strict=True)
        ]
    return tuple(
        VerifiedToken(token_id=t, logprob=lp, top=tp)
        for t, lp, tp in zip(emitted, chosen, top, strict=True)
    )
