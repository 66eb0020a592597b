"""Per-sequence sampling state the target keeps for each sequence id.

Words:
- generator: the sequence's own random stream. Seeded with `params.seed` when set, else with a
  fresh random 64-bit seed, so the same seed gives the same output whatever else is in the batch.
- seen: bool mask [V] of tokens in the prompt or the output (repetition penalty).
- output counts: float counts [V] of output tokens (frequency and presence penalties).
Both are allocated only when some penalty is active (`needs_penalties`).

The state is owned by one sequence; `sample` consumes its generator but never records tokens:
the caller calls `observe_output` once a token is committed (sampled, or accepted in verify).
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence

import torch
from torch import Tensor

from tandem.errors import FailedPrecondition
from tandem.sampling.params import SamplingParams


class SamplingState:
    """Mutable sampling state of one sequence: params, generator, penalty bookkeeping."""

    def __init__(
        self, params: SamplingParams, vocab_size: int, device: torch.device | str = "cpu",
        num_prompt_tokens: int = 0,
    ) -> None:
        self.params = params
        # Prefilled tokens past this many are output (a sequence resumed after preemption
        # prefills its output so far); 0: every prefilled token is prompt.
        self.num_prompt_tokens = num_prompt_tokens
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(params.seed if params.seed is not None else secrets.randbits(64))
        self.seen: Tensor | None = None  # [V] bool
        self.output_counts: Tensor | None = None  # [V] float32
        if params.has_penalties:
            self.seen = torch.zeros(vocab_size, dtype=torch.bool, device=self.device)
            self.output_counts = torch.zeros(vocab_size, dtype=torch.float32, device=self.device)
        # logit_bias as tensors, made once: a map of the whole vocabulary read as Python pairs
        # at every step cost 27 ms a sequence.
        ids, values = zip(*params.logit_bias) if params.logit_bias else ((), ())
        self.bias_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        self.bias_values = torch.tensor(values, dtype=torch.float32, device=self.device)

    @property
    def needs_penalties(self) -> bool:
        """True when the params ask for repetition, frequency or presence penalties."""
        return self.params.has_penalties

    def observe_prompt(self, token_ids: Sequence[int]) -> None:
        """Record prompt tokens (or a prompt chunk) as seen, for the repetition penalty."""
        if self.seen is None or len(token_ids) == 0:
            return
        ids = torch.as_tensor(list(token_ids), dtype=torch.long, device=self.device)
        self.seen[ids] = True

    def observe_prefill(self, position: int, token_ids: Sequence[int]) -> None:
        """Record prefilled tokens that start at `position` of the sequence: as prompt up to
        `num_prompt_tokens`, as committed output after it."""
        if self.seen is None or len(token_ids) == 0:
            return
        cut = len(token_ids)
        if self.num_prompt_tokens:
            cut = max(0, min(cut, self.num_prompt_tokens - position))
        self.observe_prompt(token_ids[:cut])
        if cut < len(token_ids):
            ids = torch.as_tensor(list(token_ids[cut:]), dtype=torch.long, device=self.device)
            self.seen[ids] = True
            self.output_counts.index_put_((ids,), torch.ones_like(ids, dtype=torch.float32), accumulate=True)

    def observe_output(self, token_id: int) -> None:
        """Record one committed output token: seen, and counted for frequency/presence."""
        if self.seen is None or self.output_counts is None:
            return
        self.seen[token_id] = True
        self.output_counts[token_id] += 1.0

    def fork(self, params: SamplingParams) -> SamplingState:
        """A child: copies of this state's penalty bookkeeping, its own generator from `params`.

        Used for n > 1: each child starts from the parent's prompt and draws its own stream.
        """
        child = SamplingState(params, self.vocab_size, self.device)
        if child.seen is None or child.output_counts is None:
            return child
        if self.seen is None or self.output_counts is None:
            raise FailedPrecondition(
                "fork: the child asks for penalties but the parent kept no seen-token bookkeeping"
            )
        child.seen.copy_(self.seen)
        child.output_counts.copy_(self.output_counts)
        return child
