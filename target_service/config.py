"""Configuration of the target service: built once in the CLI, frozen, passed down."""

from dataclasses import dataclass
from pathlib import Path

from tandem.errors import InvalidArgument
from tandem.models.kernel_plan import KernelPlan
from tandem.security.identity import Identities
from tandem.security.tls import PLAINTEXT, TlsConfig


@dataclass(frozen=True, slots=True)
class TargetConfig:
    model_dir: Path
    dtype: str = "float32"
    device: str = "cpu"
    host: str = "127.0.0.1"
    port: int = 50052
    kv_page_size: int = 16
    # Tokens of KV the cache holds over all sequences (SmolLM2-135M fp32: 45 KiB per token).
    kv_cache_tokens: int = 32768
    max_num_sequence: int = 64
    # 0: the model's max_position_embeddings.
    max_context_length: int = 0
    num_threads: int = 0  # 0: torch's default
    # The CPU kernel of each projection for 1..3 rows (--cpu-kernels); None: timed when the model loads.
    cpu_kernels: KernelPlan | None = None
    # How long a verify step waits for the draft's probabilities before verifying without them
    # (which accepts no sampled draft: a plain step, still lossless).
    draft_probs_timeout_s: float = 2.0
    # On a CUDA device, small steps replay captured CUDA graphs (tandem.models.cuda_graphs).
    cuda_graphs: bool = True
    # Prometheus /metrics over HTTP on this port, on `host` (0: off).
    metrics_port: int = 0
    # TLS on the port (with a CA: mutual TLS, methods authorized by the caller's identity) and
    # on outgoing channels; a plaintext port answering health Checks only, for probes (0: none).
    tls: TlsConfig = PLAINTEXT
    identities: Identities = Identities()
    health_port: int = 0

    def __post_init__(self) -> None:
        if self.kv_page_size <= 0:
            raise InvalidArgument(f"kv_page_size must be positive, got {self.kv_page_size}")
        if self.kv_cache_tokens < self.kv_page_size:
            raise InvalidArgument(
                f"kv_cache_tokens ({self.kv_cache_tokens}) must hold at least one page ({self.kv_page_size})"
            )
        if self.max_num_sequence <= 0:
            raise InvalidArgument(f"max_num_sequence must be positive, got {self.max_num_sequence}")

    @property
    def num_pages(self) -> int:
        return self.kv_cache_tokens // self.kv_page_size
