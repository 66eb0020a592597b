"""Configuration of the router: built once in the CLI, frozen, passed down."""

from dataclasses import dataclass, field
from pathlib import Path

from router.limits import RequestLimits
from tandem.errors import InvalidArgument
from tandem.security.tls import PLAINTEXT, TlsConfig


LOCAL_DRAFTS = ("ngram", "suffix")  # what the router drafts by itself (router/lookup.py)


@dataclass(frozen=True, slots=True)
class RouterConfig:
    model_dir: Path  # for the tokenizer and chat template; the router loads no weights
    target_address: str = "127.0.0.1:50052"
    host: str = "127.0.0.1"
    port: int = 50051
    # Engine limits (router.limits.EngineLimits documents each); 0: take the target's.
    max_num_sequence: int = 0
    max_total_sequence_length: int = 0
    kv_page_size: int = 0  # must equal the target's when set
    prefill_chunk_size: int = 512
    # Finished sequences the prefix cache keeps (-1: as many as sequence slots allow, 0: off).
    prefix_cache_max_num_recycling_seqs: int = -1
    max_waiting: int = 1024
    max_running_requests: int = 0  # requests running at once; later ones wait (0: the sequence budget)
    # The public port: concurrent calls at most (more get RESOURCE_EXHAUSTED from gRPC; 0: no
    # cap); a connection lives max_connection_age_s (then clients reconnect: load spreads over
    # replicas), its calls given max_connection_age_grace_s to finish (longer than a long
    # generation); clients may ping no more often than min_ping_interval_s.
    max_concurrent_rpcs: int = 0
    max_connection_age_s: float = 1800.0
    max_connection_age_grace_s: float = 900.0
    min_ping_interval_s: float = 10.0
    # SIGTERM: running requests get this long to finish (new ones are refused meanwhile).
    shutdown_grace_s: float = 20.0
    # max_tokens when a request leaves it unset (clipped to the rest of the context and to what
    # the KV cache can hold with the prompt).
    default_max_tokens: int = 1024
    # The draft service; None: plain decoding.
    draft_address: str | None = None
    # Drafting the router does itself from token ids (router/lookup.py), instead of a draft
    # service: "ngram" (prompt lookup, suffixes of ngram_min_n to ngram_max_n tokens), "suffix"
    # (a tree from the followers of contexts up to suffix_depth tokens, in the request and in
    # the last suffix_cache_tokens of other requests' outputs) or "".
    local_draft: str = ""
    ngram_min_n: int = 2
    ngram_max_n: int = 4
    suffix_depth: int = 6
    suffix_cache_tokens: int = 65536
    spec_draft_length: int = 4
    # Steps that decode this many sequences or more verify no drafts (0: never): a verify of
    # k + 1 tokens a sequence costs more than it saves in large batches (vLLM's
    # speculative_disable_by_batch_size). The draft keeps receiving hidden states meanwhile.
    spec_disable_batch_size: int = 0
    draft_timeout_s: float = 10.0
    draft_probe_s: float = 2.0  # a failed draft's health is checked this often until it is back
    # How long to wait for the target at start-up and per step.
    connect_timeout_s: float = 120.0
    step_timeout_s: float = 120.0
    # Prometheus /metrics over HTTP on this port, on `host` (0: off).
    metrics_port: int = 0
    # The router's identity and trust bundle for its channels to the target and the draft.
    tls: TlsConfig = PLAINTEXT
    # The public port: TLS with this certificate, client certificates required when it has a CA
    # (never `tls`'s: public clients are not the services).
    public_tls: TlsConfig = PLAINTEXT
    # Keys the public API requires (`authorization: Bearer <key>`), one a line; None: open.
    api_key_file: Path | None = None
    health_port: int = 0  # a plaintext port answering health Checks only, for probes (0: none)
    # The OpenAI-compatible HTTP API (router.http) on `host`, with public_tls and the API keys of
    # the gRPC port (0: off; the CLI's default is 8000), answering to served_model_name (empty:
    # the name in the model's config.json, else its folder's).
    http_port: int = 0
    served_model_name: str = ""
    # What one public request may ask: sizes of its fields (RequestLimits documents each).
    request_limits: RequestLimits = field(default_factory=RequestLimits)

    def __post_init__(self) -> None:
        for name in ("prefill_chunk_size", "max_waiting", "default_max_tokens", "spec_draft_length"):
            if getattr(self, name) <= 0:
                raise InvalidArgument(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("max_running_requests", "max_concurrent_rpcs", "http_port", "max_connection_age_s",
                     "max_connection_age_grace_s", "min_ping_interval_s", "shutdown_grace_s"):
            if getattr(self, name) < 0:
                raise InvalidArgument(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.local_draft not in ("", *LOCAL_DRAFTS):
            raise InvalidArgument(f"local_draft must be one of {LOCAL_DRAFTS} or empty, got {self.local_draft!r}")
        if self.local_draft and self.draft_address:
            raise InvalidArgument("a draft service and the router's own drafting are exclusive: give --draft or --local-draft")
        if self.suffix_depth < 1 or self.suffix_cache_tokens < 0:
            raise InvalidArgument(f"suffix_depth must be >= 1 and suffix_cache_tokens >= 0, got {self.suffix_depth},"
                                  f" {self.suffix_cache_tokens}")
        if not 1 <= self.ngram_min_n <= self.ngram_max_n:
            raise InvalidArgument(f"n-gram sizes need 1 <= ngram_min_n <= ngram_max_n, got {self.ngram_min_n},"
                                  f" {self.ngram_max_n}")
        if self.spec_disable_batch_size < 0:
            raise InvalidArgument(f"spec_disable_batch_size must be >= 0, got {self.spec_disable_batch_size}")
