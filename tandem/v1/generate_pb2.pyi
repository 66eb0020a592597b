from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt", "messages", "token_ids", "params")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt: str
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    params: SamplingParams
    def __init__(self, request_id: _Optional[str] = ..., prompt: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., token_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[SamplingParams, _Mapping]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty", "logit_bias", "seed", "stop", "stop_token_ids", "ignore_eos", "n", "logprobs", "top_logprobs", "speculate", "structured_output")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SPECULATE_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float
    frequency_penalty: float
    presence_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    n: int
    logprobs: bool
    top_logprobs: int
    speculate: bool
    structured_output: StructuredOutput
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., n: _Optional[int] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., speculate: _Optional[bool] = ..., structured_output: _Optional[_Union[StructuredOutput, _Mapping]] = ...) -> None: ...

class StructuredOutput(_message.Message):
    __slots__ = ("json_schema", "json_object", "regex", "grammar", "choice")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    json_object: bool
    regex: str
    grammar: str
    choice: Choices
    def __init__(self, json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., grammar: _Optional[str] = ..., choice: _Optional[_Union[Choices, _Mapping]] = ...) -> None: ...

class Choices(_message.Message):
    __slots__ = ("values",)
    VALUES_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, values: _Optional[_Iterable[str]] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "text")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    text: str
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., text: _Optional[str] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "top")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class Choice(_message.Message):
    __slots__ = ("index", "text", "token_ids", "logprobs", "finish_reason")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    index: int
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    finish_reason: str
    def __init__(self, index: _Optional[int] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., finish_reason: _Optional[str] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_prompt_tokens", "draft_tokens", "accepted_draft_tokens", "verify_steps", "accepted_by_depth")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_STEPS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_BY_DEPTH_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int
    draft_tokens: int
    accepted_draft_tokens: int
    verify_steps: int
    accepted_by_depth: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ..., draft_tokens: _Optional[int] = ..., accepted_draft_tokens: _Optional[int] = ..., verify_steps: _Optional[int] = ..., accepted_by_depth: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "choices", "usage")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    choices: _containers.RepeatedCompositeFieldContainer[Choice]
    usage: Usage
    def __init__(self, request_id: _Optional[str] = ..., choices: _Optional[_Iterable[_Union[Choice, _Mapping]]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ...) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("prompt", "messages")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, prompt: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfoResponse(_message.Message):
    __slots__ = ("model", "vocab_size", "max_context_length", "dtype", "draft_method", "spec_draft_length", "eos_token_ids")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_METHOD_FIELD_NUMBER: _ClassVar[int]
    SPEC_DRAFT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    model: str
    vocab_size: int
    max_context_length: int
    dtype: str
    draft_method: str
    spec_draft_length: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, model: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_context_length: _Optional[int] = ..., dtype: _Optional[str] = ..., draft_method: _Optional[str] = ..., spec_draft_length: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("requests_total", "requests_running", "requests_waiting", "prompt_tokens_total", "completion_tokens_total", "steps_total", "kv_pages_total", "kv_pages_free", "sequences_live", "draft_tokens_total", "accepted_draft_tokens_total", "mean_accepted_length", "acceptance_by_position", "speculation_active", "step_ms_total", "target_compute_ms_total", "cached_prompt_tokens_total", "sequences_recycled", "preemptions_total", "draft_ms_total", "draft_compute_ms_total", "time_to_first_token", "inter_token_latency", "request_duration", "prefill_step", "decode_step", "generation_tokens_total", "tokens_per_second", "uptime_s", "prefix_cache_hit_rate", "sequences_running", "sequences_waiting", "finished_by_reason", "proposed_by_position", "accepted_by_position", "kv_pages_used", "step_errors_total", "spec_paused_steps_total", "draft_failures_total", "respeculations_total", "target_restarts_total", "requests_refused_total")
    class FinishedByReasonEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    REQUESTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_RUNNING_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_WAITING_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    STEPS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_PAGES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_PAGES_FREE_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_LIVE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_DRAFT_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    MEAN_ACCEPTED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_BY_POSITION_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_ACTIVE_FIELD_NUMBER: _ClassVar[int]
    STEP_MS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    TARGET_COMPUTE_MS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_RECYCLED_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    DRAFT_COMPUTE_MS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    TIME_TO_FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    INTER_TOKEN_LATENCY_FIELD_NUMBER: _ClassVar[int]
    REQUEST_DURATION_FIELD_NUMBER: _ClassVar[int]
    PREFILL_STEP_FIELD_NUMBER: _ClassVar[int]
    DECODE_STEP_FIELD_NUMBER: _ClassVar[int]
    GENERATION_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_RUNNING_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_WAITING_FIELD_NUMBER: _ClassVar[int]
    FINISHED_BY_REASON_FIELD_NUMBER: _ClassVar[int]
    PROPOSED_BY_POSITION_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_BY_POSITION_FIELD_NUMBER: _ClassVar[int]
    KV_PAGES_USED_FIELD_NUMBER: _ClassVar[int]
    STEP_ERRORS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    SPEC_PAUSED_STEPS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FAILURES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    RESPECULATIONS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    TARGET_RESTARTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_REFUSED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    requests_total: int
    requests_running: int
    requests_waiting: int
    prompt_tokens_total: int
    completion_tokens_total: int
    steps_total: int
    kv_pages_total: int
    kv_pages_free: int
    sequences_live: int
    draft_tokens_total: int
    accepted_draft_tokens_total: int
    mean_accepted_length: float
    acceptance_by_position: _containers.RepeatedScalarFieldContainer[float]
    speculation_active: bool
    step_ms_total: float
    target_compute_ms_total: float
    cached_prompt_tokens_total: int
    sequences_recycled: int
    preemptions_total: int
    draft_ms_total: float
    draft_compute_ms_total: float
    time_to_first_token: LatencySummary
    inter_token_latency: LatencySummary
    request_duration: LatencySummary
    prefill_step: LatencySummary
    decode_step: LatencySummary
    generation_tokens_total: int
    tokens_per_second: float
    uptime_s: float
    prefix_cache_hit_rate: float
    sequences_running: int
    sequences_waiting: int
    finished_by_reason: _containers.ScalarMap[str, int]
    proposed_by_position: _containers.RepeatedScalarFieldContainer[int]
    accepted_by_position: _containers.RepeatedScalarFieldContainer[int]
    kv_pages_used: int
    step_errors_total: int
    spec_paused_steps_total: int
    draft_failures_total: int
    respeculations_total: int
    target_restarts_total: int
    requests_refused_total: int
    def __init__(self, requests_total: _Optional[int] = ..., requests_running: _Optional[int] = ..., requests_waiting: _Optional[int] = ..., prompt_tokens_total: _Optional[int] = ..., completion_tokens_total: _Optional[int] = ..., steps_total: _Optional[int] = ..., kv_pages_total: _Optional[int] = ..., kv_pages_free: _Optional[int] = ..., sequences_live: _Optional[int] = ..., draft_tokens_total: _Optional[int] = ..., accepted_draft_tokens_total: _Optional[int] = ..., mean_accepted_length: _Optional[float] = ..., acceptance_by_position: _Optional[_Iterable[float]] = ..., speculation_active: _Optional[bool] = ..., step_ms_total: _Optional[float] = ..., target_compute_ms_total: _Optional[float] = ..., cached_prompt_tokens_total: _Optional[int] = ..., sequences_recycled: _Optional[int] = ..., preemptions_total: _Optional[int] = ..., draft_ms_total: _Optional[float] = ..., draft_compute_ms_total: _Optional[float] = ..., time_to_first_token: _Optional[_Union[LatencySummary, _Mapping]] = ..., inter_token_latency: _Optional[_Union[LatencySummary, _Mapping]] = ..., request_duration: _Optional[_Union[LatencySummary, _Mapping]] = ..., prefill_step: _Optional[_Union[LatencySummary, _Mapping]] = ..., decode_step: _Optional[_Union[LatencySummary, _Mapping]] = ..., generation_tokens_total: _Optional[int] = ..., tokens_per_second: _Optional[float] = ..., uptime_s: _Optional[float] = ..., prefix_cache_hit_rate: _Optional[float] = ..., sequences_running: _Optional[int] = ..., sequences_waiting: _Optional[int] = ..., finished_by_reason: _Optional[_Mapping[str, int]] = ..., proposed_by_position: _Optional[_Iterable[int]] = ..., accepted_by_position: _Optional[_Iterable[int]] = ..., kv_pages_used: _Optional[int] = ..., step_errors_total: _Optional[int] = ..., spec_paused_steps_total: _Optional[int] = ..., draft_failures_total: _Optional[int] = ..., respeculations_total: _Optional[int] = ..., target_restarts_total: _Optional[int] = ..., requests_refused_total: _Optional[int] = ...) -> None: ...

class LatencySummary(_message.Message):
    __slots__ = ("count", "sum", "p50", "p90", "p99")
    COUNT_FIELD_NUMBER: _ClassVar[int]
    SUM_FIELD_NUMBER: _ClassVar[int]
    P50_FIELD_NUMBER: _ClassVar[int]
    P90_FIELD_NUMBER: _ClassVar[int]
    P99_FIELD_NUMBER: _ClassVar[int]
    count: int
    sum: float
    p50: float
    p90: float
    p99: float
    def __init__(self, count: _Optional[int] = ..., sum: _Optional[float] = ..., p50: _Optional[float] = ..., p90: _Optional[float] = ..., p99: _Optional[float] = ...) -> None: ...
