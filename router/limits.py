"""The limits of the router: what one public request may ask (RequestLimits, fixed by the
operator), and the engine limits it schedules against (EngineLimits, resolved once at start-up
from the router's flags and what the target (and draft) report, checked for consistency)."""

from dataclasses import dataclass, fields

from tandem.errors import InvalidArgument
from tandem.ops import EngineInfo
from tandem.sampling.params import MAX_TOP_LOGPROBS


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """Size caps of one public request. Each is checked before the work it bounds (a prompt's
    bytes before it is tokenized, a map's entries before they are read), and a request past one
    gets INVALID_ARGUMENT naming the field and the limit. Prompt tokens are capped by the
    target's context; the whole message by gRPC (grpc_server.PUBLIC_MAX_MESSAGE_BYTES).

    max_request_id_bytes: request_id, echoed in every response, logs and traces.
    max_prompt_bytes: the prompt's UTF-8 bytes, or all messages' contents together (tokenizing
        takes about half a second a MiB, on a thread, and must not hold the request's deadline).
    max_messages: chat messages.
    max_n: choices per request.
    max_stop_strings, max_stop_chars: each stop string is matched at every streamed character of
        every choice: bounded, so one request cannot stall the event loop (OpenAI takes 4).
    max_stop_token_ids, max_logit_bias: entries of those lists and maps.
    max_top_logprobs: at most what the engine ranks (tandem.sampling.params.MAX_TOP_LOGPROBS).
    """

    max_request_id_bytes: int = 256
    max_prompt_bytes: int = 4 * 1024 * 1024
    max_messages: int = 1024
    max_n: int = 64
    max_stop_strings: int = 32
    max_stop_chars: int = 1024
    max_stop_token_ids: int = 1024
    max_logit_bias: int = 1024
    max_top_logprobs: int = MAX_TOP_LOGPROBS

    def __post_init__(self) -> None:
        for f in fields(self):
            if getattr(self, f.name) < 1:
                raise InvalidArgument(f"{f.name} must be positive, got {getattr(self, f.name)}")
        if self.max_top_logprobs > MAX_TOP_LOGPROBS:
            raise InvalidArgument(f"max_top_logprobs ({self.max_top_logprobs}) exceeds what the engine ranks ({MAX_TOP_LOGPROBS})")


@dataclass(frozen=True, slots=True)
class EngineLimits:
    """
    max_num_sequence: the sequence budget of a step. As in MLC-LLM, a running sequence counts
        spec_draft_length + 1 when speculation is on (a verify step scores that many tokens for
        it), 1 otherwise. Default: the target's max_num_sequence.
    max_held_sequences: sequences the model services may hold at once: running, parents and
        recycled ones kept by the prefix cache (the least recently recycled is evicted first).
        The smaller of the target's and the draft's max_num_sequence.
    max_total_sequence_length: tokens over all live sequences. Default: the KV cache's size.
    prefill_chunk_size: prompt tokens per step; longer prompts are prefilled in chunks.
    spec_draft_length: draft tokens per verify (k); 0 without a draft service.
    spec_disable_batch_size: steps that decode this many sequences or more carry no drafts and
        reserve no KV for them (0: never; 0 without a draft service).
    prefix_cache_max_num_recycling_seqs: finished sequences kept for later prompts to match
        (-1: no limit but max_held_sequences, 0: prefix cache off).
    kv_page_size, kv_pages_total: the target's paged KV cache.
    max_waiting: requests queued before new ones get RESOURCE_EXHAUSTED.
    max_running_requests: requests running (prefill or decode) at once; later ones wait
        (0: as many as the sequence budget allows).
    sliding_window: the model's sliding window (0: none).
    """

    max_num_sequence: int
    max_held_sequences: int
    max_total_sequence_length: int
    prefill_chunk_size: int
    spec_draft_length: int
    prefix_cache_max_num_recycling_seqs: int
    kv_page_size: int
    kv_pages_total: int
    max_waiting: int = 1024
    sliding_window: int = 0
    max_draft_tokens: int = 0  # draft tokens (tree nodes) per verify at most; 0: spec_draft_length
    spec_disable_batch_size: int = 0
    max_context_length: int = 0  # the target's context (0: unchecked)
    max_running_requests: int = 0

    def __post_init__(self) -> None:
        for name in ("max_held_sequences", "prefill_chunk_size", "kv_page_size", "kv_pages_total", "max_waiting"):
            if getattr(self, name) <= 0:
                raise InvalidArgument(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_held_sequences < 2:
            raise InvalidArgument(
                f"max_held_sequences ({self.max_held_sequences}) must be at least 2: a request tree"
                " holds its parent and a child at once"
            )
        if self.spec_draft_length < 0:
            raise InvalidArgument(f"spec_draft_length must be >= 0, got {self.spec_draft_length}")
        if self.max_num_sequence < self.slots_per_sequence:
            raise InvalidArgument(
                f"max_num_sequence ({self.max_num_sequence}) runs no sequence: each counts"
                f" spec_draft_length + 1 = {self.slots_per_sequence}"
            )
        if self.prefix_cache_max_num_recycling_seqs < -1:
            raise InvalidArgument("prefix_cache_max_num_recycling_seqs must be -1 (no limit) or >= 0")
        if not 0 < self.max_total_sequence_length <= self.kv_pages_total * self.kv_page_size:
            raise InvalidArgument(
                f"max_total_sequence_length ({self.max_total_sequence_length}) must be in"
                f" [1, {self.kv_pages_total * self.kv_page_size}] (the KV cache's tokens)"
            )

    def why_never_fits(self, tokens: int) -> str:
        """Why a sequence of `tokens` (prompt + max_tokens) can never run here ('' if it can)."""
        if tokens > self.max_sequence_tokens:
            return (f"prompt + max_tokens = {tokens} tokens can never fit: the KV cache holds"
                    f" {self.kv_pages_total} KV pages of {self.kv_page_size} tokens"
                    f" (max_total_sequence_length {self.max_total_sequence_length})")
        if self.max_context_length and tokens > self.max_context_length:
            return f"prompt + max_tokens = {tokens} tokens exceed the model's context ({self.max_context_length})"
        return ""

    @property
    def drafts_per_verify(self) -> int:
        """KV slots a speculating sequence's verify may take beyond its own token."""
        return self.max_draft_tokens or self.spec_draft_length

    @property
    def max_sequence_tokens(self) -> int:
        """Tokens (prompt + max_tokens) one sequence can ever hold here: the total length, and
        the KV cache less a page of headroom."""
        return min(self.max_total_sequence_length, (self.kv_pages_total - 1) * self.kv_page_size)

    @property
    def slots_per_sequence(self) -> int:
        return self.spec_draft_length + 1

    @property
    def max_running(self) -> int:
        """Sequences that may run (prefill or decode) in one step."""
        return self.max_num_sequence // self.slots_per_sequence


def resolve_limits(config, info: EngineInfo, draft_max_num_sequence: int | None,
                   draft_max_tokens: int = 0) -> EngineLimits:
    """`config`: the RouterConfig (0 = take the target's value); `draft_max_num_sequence`:
    None without a draft service; `draft_max_tokens`: tree nodes per sequence (0: a chain of k)."""
    if config.kv_page_size and config.kv_page_size != info.kv_page_size:
        raise InvalidArgument(
            f"kv_page_size ({config.kv_page_size}) differs from the target's ({info.kv_page_size})"
        )
    held = info.max_num_sequence
    if draft_max_num_sequence is not None:
        held = min(held, draft_max_num_sequence)
    k = config.spec_draft_length if config.draft_address or config.local_draft else 0
    recycling = config.prefix_cache_max_num_recycling_seqs
    return EngineLimits(
        max_num_sequence=config.max_num_sequence or info.max_num_sequence,
        max_held_sequences=held,
        max_total_sequence_length=config.max_total_sequence_length or info.kv_pages_total * info.kv_page_size,
        prefill_chunk_size=config.prefill_chunk_size,
        spec_draft_length=k,
        prefix_cache_max_num_recycling_seqs=recycling,
        kv_page_size=info.kv_page_size,
        kv_pages_total=info.kv_pages_total,
        max_waiting=config.max_waiting,
        sliding_window=info.sliding_window,
        max_draft_tokens=max(k, draft_max_tokens) if k else 0,
        spec_disable_batch_size=config.spec_disable_batch_size if k else 0,
        max_context_length=info.max_context_length,
        max_running_requests=config.max_running_requests,
    )
