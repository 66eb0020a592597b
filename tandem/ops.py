"""Domain types of the router <-> model service protocol (engine.proto without protobuf).

The router names every sequence and sends these; the model services execute them in order.
"""

from dataclasses import dataclass
from enum import Enum

from tandem.sampling.params import SamplingParams


@dataclass(frozen=True, slots=True)
class AddSequence:
    seq_id: int
    sampler: SamplingParams
    # Tokens past this many are output already generated (a sequence resumed after preemption
    # prefills them): the penalties count them. 0: all prompt.
    num_prompt_tokens: int = 0


@dataclass(frozen=True, slots=True)
class ForkSequence:
    """The child shares the parent's first `position` tokens of KV."""

    seq_id: int
    parent_id: int
    position: int
    sampler: SamplingParams
    # Router-internal, never sent: where the draft forks when that differs from `position`
    # (an n > 1 child forks at L - 1 in the target, at L - 2 in the draft). None: `position`.
    draft_position: int | None = None
    num_prompt_tokens: int = 0  # as in AddSequence, over the shared tokens too


@dataclass(frozen=True, slots=True)
class PopTokens:
    seq_id: int
    count: int


@dataclass(frozen=True, slots=True)
class RemoveSequence:
    seq_id: int


SequenceOp = AddSequence | ForkSequence | PopTokens | RemoveSequence


class EntryKind(Enum):
    PREFILL = 0  # prompt tokens: a whole prompt or one chunk of it
    DECODE = 1  # the token sampled in the previous step, already counted as output


@dataclass(frozen=True, slots=True)
class StepEntry:
    seq_id: int
    kind: EntryKind
    token_ids: tuple[int, ...]
    sample: bool  # false for a prefill chunk with prompt left
    num_draft_tokens: int = 0  # DECODE: the trailing token_ids that are drafts to verify
    emit_hidden: bool = False  # stream accepted positions' hidden states to the draft peer
    # A token tree: the parent node of each draft (node 0 = the first token); () = a chain.
    tree_parents: tuple[int, ...] = ()
    # The tree's children were sampled from distributions the draft streams (else: top-k).
    sampled_tree: bool = False


@dataclass(frozen=True, slots=True)
class StepRequest:
    step_id: int
    ops: tuple[SequenceOp, ...] = ()
    entries: tuple[StepEntry, ...] = ()
    draft_step_id: int = 0  # whose draft probabilities the sampled drafts came from


@dataclass(frozen=True, slots=True)
class SampledToken:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, slots=True)
class EntryResult:
    seq_id: int
    tokens: tuple[SampledToken, ...]
    num_accepted: int = 0


@dataclass(frozen=True, slots=True)
class StepResult:
    step_id: int
    results: tuple[EntryResult, ...]
    kv_pages_free: int
    compute_ms: float


@dataclass(frozen=True, slots=True)
class EngineInfo:
    model: str
    architecture: str
    vocab_size: int
    max_context_length: int
    kv_page_size: int
    kv_pages_total: int
    max_num_sequence: int
    dtype: str
    hidden_size: int
    sliding_window: int = 0  # 0: none
    instance_id: str = ""  # random, one per process (see engine.proto)


@dataclass(frozen=True, slots=True)
class LatencySummary:
    """A latency histogram as the Stats RPCs report it (seconds)."""

    count: int = 0
    sum: float = 0.0
    p50: float = 0.0
    p90: float = 0.0
    p99: float = 0.0


@dataclass(frozen=True, slots=True)
class EngineStats:
    kv_pages_total: int
    kv_pages_free: int
    sequences_live: int
    steps_total: int = 0
    tokens_total: int = 0
    last_step_id: int = 0
    # tandem.figures.EngineFigures: tokens by kind, step compute time, throughput.
    prefill_tokens_total: int = 0
    decode_tokens_total: int = 0
    verified_draft_tokens_total: int = 0
    proposed_draft_tokens_total: int = 0
    step_seconds: LatencySummary = LatencySummary()
    uptime_s: float = 0.0
    tokens_per_second: float = 0.0  # tokens run per second over the last minute


@dataclass(frozen=True, slots=True)
class DraftSeq:
    seq_id: int
    num_tokens: int


@dataclass(frozen=True, slots=True)
class DraftRequest:
    draft_step_id: int
    after_target_step: int
    ops: tuple[SequenceOp, ...] = ()
    seqs: tuple[DraftSeq, ...] = ()


@dataclass(frozen=True, slots=True)
class DraftResult:
    draft_step_id: int
    tokens: dict  # seq_id -> tuple of draft token ids (empty: no draft for that sequence)
    compute_ms: float = 0.0
    parents: dict | None = None  # seq_id -> tree parents of its drafts (absent or (): a chain)
    sampled_trees: frozenset = frozenset()  # seq_ids whose tree children were sampled
