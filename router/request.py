"""A request as the router sees it: what was asked (frozen) and how far each of its sequences
got (mutable, owned by the router engine). No gRPC, no tensors.

Words (MLC-LLM's request state tree):
- sequence: one KV sequence of the model services, named by the router's `seq_id`.
- parent: for n > 1, the sequence that prefills the prompt but its last token once; it samples
  nothing. Its n children each fork it, prefill the last prompt token with their own sampler
  (their own random stream) and decode. For n = 1 the request is one sequence, no parent.
- activated: a child whose sequence has been forked; the rest wait for sequence slots.
- root: a sequence that enters the model services by add / prefix-cache match (a single
  sequence, a parent, or a preempted sequence that resumes), as opposed to a child's fork.
"""

import asyncio
from dataclasses import dataclass, field, replace
from enum import Enum

from router.draft_mirror import DraftState, Seat
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
    n: int = 1


@dataclass(frozen=True, slots=True)
class TokenOut:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, slots=True)
class Delta:
    """What one step added to one choice's stream."""

    text: str
    tokens: tuple[TokenOut, ...]
    finish_reason: FinishReason | None = None
    index: int = 0


PARENT = -1  # the index of a parent sequence


@dataclass(eq=False, slots=True)
class Sequence:
    """Progress of one sequence of a request (compared by identity)."""

    request: "Request"
    seq_id: int
    index: int  # the choice it streams under; PARENT for a parent
    input_ids: tuple[int, ...]  # what its KV must hold before it samples
    sampler: SamplingParams  # a child's own seed
    num_prefilled: int = 0  # input tokens already in the target's KV
    pending_token: int | None = None  # sampled, not yet in the KV: the next decode input
    output_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    live: bool = False  # the target holds a sequence for it
    draft: DraftState = field(default_factory=DraftState)  # its standing with the draft service
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0
    verify_steps: int = 0
    accepted_by_depth: list[int] = field(default_factory=list)
    output: object = None  # its OutputProcessor (not for a parent)
    lookup: object = None  # its n-gram index (router/ngram.py) when the router drafts

    @property
    def spec(self) -> GenerationSpec:
        return self.request.spec

    @property
    def prefill_left(self) -> int:
        return len(self.input_ids) - self.num_prefilled

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def is_parent(self) -> bool:
        return self.index == PARENT

    @property
    def draft_live(self) -> bool:
        """The draft service holds a sequence for it too: it speculates."""
        return self.draft.seat is Seat.LIVE

    @property
    def draft_denied(self) -> bool:
        """The draft was full when it came in: it takes a place that frees."""
        return self.draft.seat is Seat.DENIED


@dataclass(eq=False, slots=True)
class Request:
    """One Generate call: its choices (n sequences), maybe a parent, and the stream of deltas
    the Generate handler drains."""

    spec: GenerationSpec
    choices: list[Sequence] = field(default_factory=list)
    parent: Sequence | None = None
    unactivated: list[Sequence] = field(default_factory=list)  # children not forked yet
    cached_prompt_tokens: int = 0
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)  # Delta | TandemError

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.choices)


def child_sampler(params: SamplingParams, index: int, n: int) -> SamplingParams:
    """A child's own random stream: seeded from the request seed and its index (n > 1), so
    seeded children are reproducible and differ from each other."""
    if n == 1 or params.seed is None:
        return params
    return replace(params, seed=_splitmix64(params.seed + index))


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


def new_request(spec: GenerationSpec, next_seq_id) -> Request:
    """The request state tree: one sequence for n = 1; for n > 1 a parent that prefills the
    prompt but its last token and n children (named when activated), each with its own stream.
    A one-token prompt has nothing to share: n independent sequences."""
    request = Request(spec)
    tree = spec.n > 1 and len(spec.prompt_ids) > 1
    for i in range(spec.n):
        sampler = child_sampler(spec.sampler, i, spec.n)
        request.choices.append(Sequence(request, 0 if tree else next_seq_id(), i, spec.prompt_ids, sampler))
    if tree:
        request.parent = Sequence(request, next_seq_id(), PARENT, spec.prompt_ids[:-1], spec.sampler)
        request.unactivated = list(request.choices)
    return request
