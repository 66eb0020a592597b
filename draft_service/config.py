"""Configuration of the draft service: built once in the CLI, frozen, passed down."""

from dataclasses import dataclass
from pathlib import Path

from tandem.errors import InvalidArgument


@dataclass(frozen=True, slots=True)
class DraftConfig:
    method: str  # a key of draft_service.methods.DRAFT_METHODS
    model_dir: Path  # the draft head's checkpoint folder
    target_model_dir: Path  # the target's folder: the head shares its embedding and lm_head
    target_address: str = "127.0.0.1:50052"  # where the peer stream goes
    dtype: str = "float32"
    device: str = "cpu"
    host: str = "127.0.0.1"
    port: int = 50053
    kv_page_size: int = 16
    kv_cache_tokens: int = 32768
    max_num_sequence: int = 64
    num_threads: int = 0
    # How long a Draft call waits for the target step whose hidden states it needs.
    hidden_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if self.kv_cache_tokens < self.kv_page_size or self.kv_page_size <= 0:
            raise InvalidArgument(f"kv_cache_tokens ({self.kv_cache_tokens}) must hold a page ({self.kv_page_size})")
