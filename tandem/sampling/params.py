"""Sampling parameters of one sequence: what the client asked for, validated once.

Words:
- greedy: temperature 0; the token is the argmax of the processed logits.
- penalties: repetition (HF/CTRL: every token seen in the prompt or the output has a positive
  logit divided by, a negative logit multiplied by, `repetition_penalty`), frequency and
  presence (OpenAI: on output tokens only, `logit -= frequency * count + presence * (count > 0)`).
- filters: top-k, top-p and min-p, applied to the tempered distribution (see sampler.py).
- keyed: a seeded sampled sequence whose token at each index is drawn with noise keyed by
  (seed, index) instead of its random stream's next numbers (see keyed.py): the router asks it
  for every seeded request, so that the output does not depend on the schedule.
- structured output: a grammar (JSON schema, regex, Lark, choice) whose mask the target applies
  to the logits before all of the above (docs/structured-output.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tandem.errors import InvalidArgument
from tandem.structured.spec import StructuredOutput

MAX_TOP_LOGPROBS = 20
_MAX_PENALTY = 2.0
_UINT64_MAX = 2**64 - 1


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one sequence turns logits into tokens. Defaults: plain sampling at temperature 1."""

    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # 1 = off
    top_k: int = 0  # 0 = off
    min_p: float = 0.0  # 0 = off
    repetition_penalty: float = 1.0  # 1 = off
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    seed: int | None = None  # None: a fresh random seed per sequence
    logprobs: bool = False
    top_logprobs: int = 0
    keyed_draws: bool = False  # with a seed: position-keyed draws (keyed.py)
    # The grammar the output keeps to (tandem/structured); None: free text.
    structured_output: StructuredOutput | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def keyed(self) -> bool:
        """Sampled with position-keyed draws: no random stream, no proposal needed to verify."""
        return self.keyed_draws and self.seed is not None and not self.greedy

    @property
    def has_penalties(self) -> bool:
        """True when some penalty changes logits (and so needs seen-token bookkeeping)."""
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )

    def validate(self, vocab_size: int) -> None:
        """Raise InvalidArgument naming the first bad field (`params.<field>`) and its value."""
        t = self.temperature
        _check(math.isfinite(t) and t >= 0, "temperature", t, "must be finite and >= 0")
        _check(0 < self.top_p <= 1, "top_p", self.top_p, "must be in (0, 1]")
        _check(self.top_k >= 0, "top_k", self.top_k, "must be >= 0 (0 = off)")
        _check(0 <= self.min_p <= 1, "min_p", self.min_p, "must be in [0, 1]")
        rp = self.repetition_penalty
        _check(math.isfinite(rp) and rp > 0, "repetition_penalty", rp, "must be finite and > 0")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            ok = -_MAX_PENALTY <= value <= _MAX_PENALTY
            _check(ok, name, value, f"must be in [-{_MAX_PENALTY:g}, {_MAX_PENALTY:g}]")
        for token_id, bias in self.logit_bias:
            ok_id = 0 <= token_id < vocab_size
            _check(ok_id, "logit_bias", token_id, f"token id must be in [0, {vocab_size})")
            rule = f"bias of token {token_id} must be finite"
            _check(math.isfinite(bias), "logit_bias", bias, rule)
        n = self.top_logprobs
        _check(0 <= n <= MAX_TOP_LOGPROBS, "top_logprobs", n, f"must be in [0, {MAX_TOP_LOGPROBS}]")
        if self.seed is not None:
            ok = 0 <= self.seed <= _UINT64_MAX
            _check(ok, "seed", self.seed, "must fit in an unsigned 64-bit integer")
        if self.structured_output is not None:
            self.structured_output.validate()  # what needs no compiler; compiling: tandem/structured


def _check(ok: bool, field: str, value: object, rule: str) -> None:
    if not ok:
        raise InvalidArgument(f"params.{field} = {value!r}: {rule}")
