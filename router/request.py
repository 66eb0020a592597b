"""A request as the router sees it: what was asked (frozen) and how far it got (mutable, owned
by the router engine). No gRPC, no tensors."""

from dataclasses import dataclass, field
from enum import Enum

from tandem.sampling.params import SamplingParams


class FinishReason(str, Enum):
    STOP = "stop"
    LENGTH = "length"
    CANCELLED = "cancelled"


@dataclass(frozen=True, slots=True)
class GenerationSpec:
    """A validated request: prompt tokens, sampling and stop conditions."""

    request_id: str
    prompt_ids: tuple[int, ...]
    sampler: SamplingParams
    max_tokens: int
    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()  # eos included unless ignore_eos
    speculate: bool = True


@dataclass(frozen=True, slots=True)
class TokenOut:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, slots=True)
class Delta:
    """What one step added to a request's stream."""

    text: str
    tokens: tuple[TokenOut, ...]
    finish_reason: FinishReason | None = None


@dataclass(slots=True)
class RequestState:
    """Progress of one running or waiting request; its sequence id is the router's to name."""

    spec: GenerationSpec
    seq_id: int
    reserved_pages: int
    num_prefilled: int = 0  # prompt tokens already in the target's KV
    pending_token: int | None = None  # sampled, not yet in the KV: the next decode input
    output_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    live: bool = False  # the target holds a sequence for it
    draft_live: bool = False  # the draft service holds one too: this request speculates
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0

    @property
    def prefill_left(self) -> int:
        return len(self.spec.prompt_ids) - self.num_prefilled

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
