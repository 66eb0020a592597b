"""Rotary position embeddings. The inverse frequencies of every scaling (linear, llama3, yarn)
come from transformers' own ROPE_INIT_FUNCTIONS, so they match the reference exactly."""

from pathlib import Path

import torch

from tandem.errors import InvalidArgument

# Position-independent scalings only: "dynamic" and "longrope" change with the sequence length.
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def inverse_frequencies(model_dir: Path) -> tuple[torch.Tensor, float]:
    """Returns (inv_freq [head_dim / 2] fp32, attention_scaling) for the model's rope config."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = AutoConfig.from_pretrained(model_dir)
    params = config.rope_parameters
    if "full_attention" in params:  # per-layer-type rope configs: decoder layers use this one
        params = params["full_attention"]
    rope_type = params.get("rope_type", "default")
    if rope_type not in STATIC_ROPE_TYPES:
        raise InvalidArgument(f"rope_type {rope_type!r} is not supported; supported: {STATIC_ROPE_TYPES}")
    if rope_type == "default":
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        exponents = torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim
        return 1.0 / (params["rope_theta"] ** exponents), 1.0
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config)
    return inv_freq.float(), float(scaling)


def rope_tables(inv_freq: torch.Tensor, scaling: float, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [max_positions, head_dim] in fp32, halves repeated (the rotate-half layout)."""
    positions = torch.arange(max_positions, dtype=torch.float32)
    freqs = torch.outer(positions, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * scaling, emb.sin() * scaling


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """sin with its first half negated, so that rotate_half(x) * sin == roll(x) * signed_sin."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim]; cos and signed_sin(sin) [T, head_dim] at each token's position.

    rotate_half(x) = cat(-x2, x1) = roll(x, half) with the first half negated: 3 ops, not 7."""
    rolled = torch.roll(x, x.shape[-1] // 2, dims=-1)
    return torch.addcmul(x * cos[:, None, :], rolled, signed[:, None, :])
