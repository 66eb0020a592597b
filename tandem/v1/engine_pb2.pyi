from tandem.v1 import generate_pb2 as _generate_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class SeqHidden(_message.Message):
    __slots__ = ("seq_id", "start", "tokens", "hidden")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    start: int
    tokens: _containers.RepeatedScalarFieldContainer[int]
    hidden: Tensor
    def __init__(self, seq_id: _Optional[int] = ..., start: _Optional[int] = ..., tokens: _Optional[_Iterable[int]] = ..., hidden: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class TargetToDraft(_message.Message):
    __slots__ = ("step_id", "seqs", "trace_context")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    SEQS_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    seqs: _containers.RepeatedCompositeFieldContainer[SeqHidden]
    trace_context: _containers.ScalarMap[str, str]
    def __init__(self, step_id: _Optional[int] = ..., seqs: _Optional[_Iterable[_Union[SeqHidden, _Mapping]]] = ..., trace_context: _Optional[_Mapping[str, str]] = ...) -> None: ...

class SeqDraftProbs(_message.Message):
    __slots__ = ("seq_id", "probs", "shape", "values", "rows", "flat_index", "on_columns")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    FLAT_INDEX_FIELD_NUMBER: _ClassVar[int]
    ON_COLUMNS_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    probs: Tensor
    shape: _containers.RepeatedScalarFieldContainer[int]
    values: Tensor
    rows: _containers.RepeatedScalarFieldContainer[int]
    flat_index: Tensor
    on_columns: bool
    def __init__(self, seq_id: _Optional[int] = ..., probs: _Optional[_Union[Tensor, _Mapping]] = ..., shape: _Optional[_Iterable[int]] = ..., values: _Optional[_Union[Tensor, _Mapping]] = ..., rows: _Optional[_Iterable[int]] = ..., flat_index: _Optional[_Union[Tensor, _Mapping]] = ..., on_columns: _Optional[bool] = ...) -> None: ...

class DraftToTarget(_message.Message):
    __slots__ = ("draft_step_id", "seqs", "columns", "hello")
    DRAFT_STEP_ID_FIELD_NUMBER: _ClassVar[int]
    SEQS_FIELD_NUMBER: _ClassVar[int]
    COLUMNS_FIELD_NUMBER: _ClassVar[int]
    HELLO_FIELD_NUMBER: _ClassVar[int]
    draft_step_id: int
    seqs: _containers.RepeatedCompositeFieldContainer[SeqDraftProbs]
    columns: Tensor
    hello: PeerHello
    def __init__(self, draft_step_id: _Optional[int] = ..., seqs: _Optional[_Iterable[_Union[SeqDraftProbs, _Mapping]]] = ..., columns: _Optional[_Union[Tensor, _Mapping]] = ..., hello: _Optional[_Union[PeerHello, _Mapping]] = ...) -> None: ...

class PeerHello(_message.Message):
    __slots__ = ("feature_layers",)
    FEATURE_LAYERS_FIELD_NUMBER: _ClassVar[int]
    feature_layers: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, feature_layers: _Optional[_Iterable[int]] = ...) -> None: ...

class DraftInfo(_message.Message):
    __slots__ = ("method", "model", "hidden_size", "vocab_size", "dtype", "max_num_sequence", "max_draft_tokens", "shape")
    METHOD_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    MAX_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    method: str
    model: str
    hidden_size: int
    vocab_size: int
    dtype: str
    max_num_sequence: int
    max_draft_tokens: int
    shape: str
    def __init__(self, method: _Optional[str] = ..., model: _Optional[str] = ..., hidden_size: _Optional[int] = ..., vocab_size: _Optional[int] = ..., dtype: _Optional[str] = ..., max_num_sequence: _Optional[int] = ..., max_draft_tokens: _Optional[int] = ..., shape: _Optional[str] = ...) -> None: ...

class DraftSeq(_message.Message):
    __slots__ = ("seq_id", "num_tokens")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    num_tokens: int
    def __init__(self, seq_id: _Optional[int] = ..., num_tokens: _Optional[int] = ...) -> None: ...

class DraftRequest(_message.Message):
    __slots__ = ("draft_step_id", "after_target_step", "ops", "seqs", "trace_context")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    DRAFT_STEP_ID_FIELD_NUMBER: _ClassVar[int]
    AFTER_TARGET_STEP_FIELD_NUMBER: _ClassVar[int]
    OPS_FIELD_NUMBER: _ClassVar[int]
    SEQS_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    draft_step_id: int
    after_target_step: int
    ops: _containers.RepeatedCompositeFieldContainer[SequenceOp]
    seqs: _containers.RepeatedCompositeFieldContainer[DraftSeq]
    trace_context: _containers.ScalarMap[str, str]
    def __init__(self, draft_step_id: _Optional[int] = ..., after_target_step: _Optional[int] = ..., ops: _Optional[_Iterable[_Union[SequenceOp, _Mapping]]] = ..., seqs: _Optional[_Iterable[_Union[DraftSeq, _Mapping]]] = ..., trace_context: _Optional[_Mapping[str, str]] = ...) -> None: ...

class DraftTokens(_message.Message):
    __slots__ = ("seq_id", "token_ids", "parents", "sampled_tree")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_TREE_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    parents: _containers.RepeatedScalarFieldContainer[int]
    sampled_tree: bool
    def __init__(self, seq_id: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., parents: _Optional[_Iterable[int]] = ..., sampled_tree: _Optional[bool] = ...) -> None: ...

class DraftResponse(_message.Message):
    __slots__ = ("draft_step_id", "seqs", "compute_ms", "error")
    DRAFT_STEP_ID_FIELD_NUMBER: _ClassVar[int]
    SEQS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    draft_step_id: int
    seqs: _containers.RepeatedCompositeFieldContainer[DraftTokens]
    compute_ms: float
    error: StepError
    def __init__(self, draft_step_id: _Optional[int] = ..., seqs: _Optional[_Iterable[_Union[DraftTokens, _Mapping]]] = ..., compute_ms: _Optional[float] = ..., error: _Optional[_Union[StepError, _Mapping]] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EngineInfo(_message.Message):
    __slots__ = ("model", "architecture", "vocab_size", "max_context_length", "kv_page_size", "kv_pages_total", "max_num_sequence", "dtype", "hidden_size", "sliding_window", "instance_id")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    KV_PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_PAGES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    SLIDING_WINDOW_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    model: str
    architecture: str
    vocab_size: int
    max_context_length: int
    kv_page_size: int
    kv_pages_total: int
    max_num_sequence: int
    dtype: str
    hidden_size: int
    sliding_window: int
    instance_id: str
    def __init__(self, model: _Optional[str] = ..., architecture: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_context_length: _Optional[int] = ..., kv_page_size: _Optional[int] = ..., kv_pages_total: _Optional[int] = ..., max_num_sequence: _Optional[int] = ..., dtype: _Optional[str] = ..., hidden_size: _Optional[int] = ..., sliding_window: _Optional[int] = ..., instance_id: _Optional[str] = ...) -> None: ...

class SamplerConfig(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty", "logit_bias", "seed", "logprobs", "top_logprobs", "keyed_draws", "structured_output")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    KEYED_DRAWS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float
    frequency_penalty: float
    presence_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    seed: int
    logprobs: bool
    top_logprobs: int
    keyed_draws: bool
    structured_output: _generate_pb2.StructuredOutput
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., seed: _Optional[int] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., keyed_draws: _Optional[bool] = ..., structured_output: _Optional[_Union[_generate_pb2.StructuredOutput, _Mapping]] = ...) -> None: ...

class AddSequence(_message.Message):
    __slots__ = ("seq_id", "sampler", "num_prompt_tokens")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLER_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    sampler: SamplerConfig
    num_prompt_tokens: int
    def __init__(self, seq_id: _Optional[int] = ..., sampler: _Optional[_Union[SamplerConfig, _Mapping]] = ..., num_prompt_tokens: _Optional[int] = ...) -> None: ...

class ForkSequence(_message.Message):
    __slots__ = ("seq_id", "parent_id", "position", "sampler", "num_prompt_tokens")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    PARENT_ID_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    SAMPLER_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    parent_id: int
    position: int
    sampler: SamplerConfig
    num_prompt_tokens: int
    def __init__(self, seq_id: _Optional[int] = ..., parent_id: _Optional[int] = ..., position: _Optional[int] = ..., sampler: _Optional[_Union[SamplerConfig, _Mapping]] = ..., num_prompt_tokens: _Optional[int] = ...) -> None: ...

class PopTokens(_message.Message):
    __slots__ = ("seq_id", "count")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    count: int
    def __init__(self, seq_id: _Optional[int] = ..., count: _Optional[int] = ...) -> None: ...

class RemoveSequence(_message.Message):
    __slots__ = ("seq_id",)
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    def __init__(self, seq_id: _Optional[int] = ...) -> None: ...

class SequenceOp(_message.Message):
    __slots__ = ("add", "fork", "pop", "remove")
    ADD_FIELD_NUMBER: _ClassVar[int]
    FORK_FIELD_NUMBER: _ClassVar[int]
    POP_FIELD_NUMBER: _ClassVar[int]
    REMOVE_FIELD_NUMBER: _ClassVar[int]
    add: AddSequence
    fork: ForkSequence
    pop: PopTokens
    remove: RemoveSequence
    def __init__(self, add: _Optional[_Union[AddSequence, _Mapping]] = ..., fork: _Optional[_Union[ForkSequence, _Mapping]] = ..., pop: _Optional[_Union[PopTokens, _Mapping]] = ..., remove: _Optional[_Union[RemoveSequence, _Mapping]] = ...) -> None: ...

class StepEntry(_message.Message):
    __slots__ = ("seq_id", "kind", "token_ids", "sample", "num_draft_tokens", "emit_hidden", "tree_parents", "sampled_tree")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        PREFILL: _ClassVar[StepEntry.Kind]
        DECODE: _ClassVar[StepEntry.Kind]
    PREFILL: StepEntry.Kind
    DECODE: StepEntry.Kind
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EMIT_HIDDEN_FIELD_NUMBER: _ClassVar[int]
    TREE_PARENTS_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_TREE_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    kind: StepEntry.Kind
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    sample: bool
    num_draft_tokens: int
    emit_hidden: bool
    tree_parents: _containers.RepeatedScalarFieldContainer[int]
    sampled_tree: bool
    def __init__(self, seq_id: _Optional[int] = ..., kind: _Optional[_Union[StepEntry.Kind, str]] = ..., token_ids: _Optional[_Iterable[int]] = ..., sample: _Optional[bool] = ..., num_draft_tokens: _Optional[int] = ..., emit_hidden: _Optional[bool] = ..., tree_parents: _Optional[_Iterable[int]] = ..., sampled_tree: _Optional[bool] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("step_id", "ops", "entries", "draft_step_id", "trace_context")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    OPS_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    DRAFT_STEP_ID_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    ops: _containers.RepeatedCompositeFieldContainer[SequenceOp]
    entries: _containers.RepeatedCompositeFieldContainer[StepEntry]
    draft_step_id: int
    trace_context: _containers.ScalarMap[str, str]
    def __init__(self, step_id: _Optional[int] = ..., ops: _Optional[_Iterable[_Union[SequenceOp, _Mapping]]] = ..., entries: _Optional[_Iterable[_Union[StepEntry, _Mapping]]] = ..., draft_step_id: _Optional[int] = ..., trace_context: _Optional[_Mapping[str, str]] = ...) -> None: ...

class SampledTop(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class SampledToken(_message.Message):
    __slots__ = ("token_id", "logprob", "top")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[SampledTop]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[SampledTop, _Mapping]]] = ...) -> None: ...

class EntryResult(_message.Message):
    __slots__ = ("seq_id", "tokens", "num_accepted")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    tokens: _containers.RepeatedCompositeFieldContainer[SampledToken]
    num_accepted: int
    def __init__(self, seq_id: _Optional[int] = ..., tokens: _Optional[_Iterable[_Union[SampledToken, _Mapping]]] = ..., num_accepted: _Optional[int] = ...) -> None: ...

class StepResponse(_message.Message):
    __slots__ = ("step_id", "results", "kv_pages_free", "compute_ms", "error")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    KV_PAGES_FREE_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    results: _containers.RepeatedCompositeFieldContainer[EntryResult]
    kv_pages_free: int
    compute_ms: float
    error: StepError
    def __init__(self, step_id: _Optional[int] = ..., results: _Optional[_Iterable[_Union[EntryResult, _Mapping]]] = ..., kv_pages_free: _Optional[int] = ..., compute_ms: _Optional[float] = ..., error: _Optional[_Union[StepError, _Mapping]] = ...) -> None: ...

class StepError(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class EngineStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EngineStats(_message.Message):
    __slots__ = ("kv_pages_total", "kv_pages_free", "sequences_live", "steps_total", "tokens_total", "last_step_id", "prefill_tokens_total", "decode_tokens_total", "verified_draft_tokens_total", "proposed_draft_tokens_total", "step_seconds", "uptime_s", "tokens_per_second")
    KV_PAGES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_PAGES_FREE_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_LIVE_FIELD_NUMBER: _ClassVar[int]
    STEPS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_ID_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    DECODE_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    VERIFIED_DRAFT_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    PROPOSED_DRAFT_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    kv_pages_total: int
    kv_pages_free: int
    sequences_live: int
    steps_total: int
    tokens_total: int
    last_step_id: int
    prefill_tokens_total: int
    decode_tokens_total: int
    verified_draft_tokens_total: int
    proposed_draft_tokens_total: int
    step_seconds: _generate_pb2.LatencySummary
    uptime_s: float
    tokens_per_second: float
    def __init__(self, kv_pages_total: _Optional[int] = ..., kv_pages_free: _Optional[int] = ..., sequences_live: _Optional[int] = ..., steps_total: _Optional[int] = ..., tokens_total: _Optional[int] = ..., last_step_id: _Optional[int] = ..., prefill_tokens_total: _Optional[int] = ..., decode_tokens_total: _Optional[int] = ..., verified_draft_tokens_total: _Optional[int] = ..., proposed_draft_tokens_total: _Optional[int] = ..., step_seconds: _Optional[_Union[_generate_pb2.LatencySummary, _Mapping]] = ..., uptime_s: _Optional[float] = ..., tokens_per_second: _Optional[float] = ...) -> None: ...

class ResetRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
