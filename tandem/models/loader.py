"""Loads a Hugging Face safetensors folder of a Llama-family model into our LlamaModel."""

from pathlib import Path

import torch
from safetensors.torch import load_file

from tandem.attention.base import AttentionBackend
from tandem.errors import InvalidArgument
from tandem.models.config import ModelConfig
from tandem.models.kernel_plan import KernelPlan
from tandem.models.linear import choose_kernels, make_linear
from tandem.models.llama import LayerWeights, LlamaModel, ModelWeights
from tandem.models.rope import inverse_frequencies, rope_tables

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise InvalidArgument(f"dtype {name!r} is not one of {sorted(DTYPES)}")
    return DTYPES[name]


def read_state_dict(model_dir: Path) -> dict[str, torch.Tensor]:
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise InvalidArgument(f"no *.safetensors files in {model_dir}")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(str(file)))
    return state


def build_weights(config: ModelConfig, state: dict[str, torch.Tensor], dtype: torch.dtype, device) -> ModelWeights:
    def take(name: str) -> torch.Tensor:
        if name not in state:
            raise InvalidArgument(f"checkpoint lacks weight {name}")
        return state[name].to(device=device, dtype=dtype)

    layers = []
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        qkv = torch.cat([take(p + f"self_attn.{n}_proj.weight") for n in "qkv"])
        bias = None
        if config.attention_bias:
            bias = torch.cat([take(p + f"self_attn.{n}_proj.bias") for n in "qkv"])
        layers.append(
            LayerWeights(
                input_norm=take(p + "input_layernorm.weight"),
                qkv=make_linear(qkv, bias),
                o=make_linear(take(p + "self_attn.o_proj.weight")),
                post_norm=take(p + "post_attention_layernorm.weight"),
                gate_up=make_linear(torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")])),
                down=make_linear(take(p + "mlp.down_proj.weight")),
            )
        )
    embed = take("model.embed_tokens.weight").contiguous()
    tied = config.tie_word_embeddings or "lm_head.weight" not in state
    return ModelWeights(
        embed=embed,
        layers=tuple(layers),
        norm=take("model.norm.weight").contiguous(),
        lm_head=make_linear(embed if tied else take("lm_head.weight")),
    )


def load_model(
    model_dir: Path,
    *,
    dtype: torch.dtype,
    backend: AttentionBackend,
    device: torch.device | str = "cpu",
    max_positions: int | None = None,
    kernels: KernelPlan | None = None,
) -> LlamaModel:
    """kernels: the CPU kernel plan (--cpu-kernels); None: timed on the model's projections on CPU."""
    config = ModelConfig.from_folder(model_dir)
    weights = build_weights(config, read_state_dict(model_dir), dtype, device)
    plan = choose_kernels(kernels, device, weights.projections())
    inv_freq, scaling = inverse_frequencies(model_dir)
    cos, sin = rope_tables(inv_freq, scaling, max_positions or config.max_position_embeddings)
    return LlamaModel(config, weights, cos.to(device), sin.to(device), backend, plan)
