"""The architecture facts our model code needs, read from a Hugging Face config.json."""

import json
from dataclasses import dataclass
from pathlib import Path

from tandem.errors import InvalidArgument

# Llama-family architectures that share one decoder layout (RMSNorm, RoPE, GQA, SwiGLU).
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    sliding_window: int | None
    eos_token_ids: tuple[int, ...]
    torch_dtype: str

    @staticmethod
    def from_folder(model_dir: Path) -> "ModelConfig":
        raw = json.loads((Path(model_dir) / "config.json").read_text())
        return ModelConfig.from_dict(raw)

    @staticmethod
    def from_dict(raw: dict) -> "ModelConfig":
        archs = raw.get("architectures") or []
        family = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if family is None:
            raise InvalidArgument(
                f"unsupported architectures {archs}; supported: {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        heads = raw["num_attention_heads"]
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return ModelConfig(
            architecture=family,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            max_position_embeddings=raw.get("max_position_embeddings", 4096),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            # Qwen2 always has q/k/v biases; Llama says so in attention_bias.
            attention_bias=family == "qwen2" or raw.get("attention_bias", False),
            sliding_window=_sliding_window(family, raw),
            eos_token_ids=eos_ids,
            torch_dtype=str(raw.get("dtype") or raw.get("torch_dtype") or "float32"),
        )


def _sliding_window(family: str, raw: dict) -> int | None:
    window = raw.get("sliding_window")
    if family == "qwen2" and not raw.get("use_sliding_window", False):
        return None
    if family == "llama":
        return None
    return window or None
