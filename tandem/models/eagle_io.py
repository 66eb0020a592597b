"""EAGLE-1/2 draft-head checkpoints in the public layout of SafeAILab/EAGLE (for example
yuhuili/EAGLE-llama2-chat-7B): reading, writing and random ones for tests.

A head folder holds `config.json`, a LlamaConfig with `num_hidden_layers` (1 in published heads) and often `bias`
(whether `fc` has a bias; EAGLE reads it with a default of true), and the weights as
`pytorch_model.bin` (a torch.save'd state dict; preferred when both exist, as EAGLE does) or
`model.safetensors`. Keys, with the [out, in] layout of nn.Linear:

    fc.weight [D, 2D], fc.bias [D] (when bias)
    layers.0.self_attn.{q,k,v,o}_proj.weight (+ {q,k,v}_proj.bias when the config says qkv_bias)
    layers.0.mlp.{gate,up,down}_proj.weight
    layers.0.post_attention_layernorm.weight
    layers.0.input_layernorm.weight   optional: EAGLE's layer 0 never applies it
    layers.{j}.*                      the same for each later layer j, input_layernorm required
    embed_tokens.weight               optional: a copy of the target's; the head uses the target's

This module only moves files; tandem.models.eagle checks the keys and builds the head.
"""

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tandem.errors import InvalidArgument

WEIGHT_FILES = {"bin": "pytorch_model.bin", "safetensors": "model.safetensors"}
D2T_FILE = "d2t.safetensors"  # a pruned draft vocabulary, EAGLE-3's map (Medusa heads may carry one too)


def layer_prefix(index: int) -> str:
    """The public checkpoint's prefix of decoder layer `index`."""
    return f"layers.{index}."


def read_eagle_checkpoint(head_dir: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """Returns (the raw config.json, the state dict on the CPU, public key names)."""
    head_dir = Path(head_dir)
    config_path = head_dir / "config.json"
    if not config_path.is_file():
        raise InvalidArgument(f"EAGLE head folder {head_dir} has no config.json")
    raw = json.loads(config_path.read_text())
    bin_path, st_path = head_dir / WEIGHT_FILES["bin"], head_dir / WEIGHT_FILES["safetensors"]
    if bin_path.is_file():
        state = torch.load(bin_path, map_location="cpu", weights_only=True)
    elif st_path.is_file():
        state = load_file(str(st_path))
    else:
        raise InvalidArgument(f"EAGLE head folder {head_dir} has neither {bin_path.name} nor {st_path.name}")
    return raw, state


def save_eagle_checkpoint(
    out_dir: Path, config_dict: dict, state_dict: dict[str, torch.Tensor], *, format: str = "bin"
) -> Path:
    """Writes config.json and the weights in the public format ("bin" or "safetensors");
    removes a weights file of the other format, which would otherwise shadow or be shadowed."""
    if format not in WEIGHT_FILES:
        raise InvalidArgument(f"format {format!r} is not one of {sorted(WEIGHT_FILES)}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(config_dict, indent=2, sort_keys=True) + "\n")
    tensors = {name: t.detach().cpu().contiguous() for name, t in state_dict.items()}
    for other, name in WEIGHT_FILES.items():
        if other != format:
            (out_dir / name).unlink(missing_ok=True)
    path = out_dir / WEIGHT_FILES[format]
    if format == "bin":
        torch.save(tensors, path)
    else:
        save_file(tensors, str(path), metadata={"format": "pt"})
    return out_dir


def widen_vocab(scores: torch.Tensor, vocab_ids: torch.Tensor | None, vocab_size: int) -> torch.Tensor:
    """scores [..., V'] over a pruned draft vocabulary (column j: token vocab_ids[j]) -> logits
    [..., vocab_size], -inf outside it; scores as they are without a pruned vocabulary."""
    if vocab_ids is None:
        return scores
    logits = torch.full((*scores.shape[:-1], vocab_size), float("-inf"), dtype=scores.dtype, device=scores.device)
    logits[..., vocab_ids] = scores
    return logits


def read_draft_vocab(head_dir: Path, vocab_size: int, device="cpu") -> torch.Tensor | None:
    """The target ids of a head's pruned draft vocabulary (`d2t.safetensors`, EAGLE-3's map:
    draft token i is target token i + d2t[i]), or None for the full vocabulary."""
    path = Path(head_dir) / D2T_FILE
    if not path.exists():
        return None
    return vocab_ids_from_d2t(load_file(str(path))["d2t"], vocab_size, str(path)).to(device)


def vocab_ids_from_d2t(d2t: torch.Tensor, vocab_size: int, where: str) -> torch.Tensor:
    """The target id of each draft token (draft id + d2t[draft id]); InvalidArgument unless they
    map the draft vocabulary into [0, vocab_size) one to one."""
    ids = torch.arange(d2t.shape[0]) + d2t.to(torch.int64)
    if ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= vocab_size or ids.unique().numel() != ids.numel():
        raise InvalidArgument(f"{where}: d2t does not map the draft vocabulary into [0, {vocab_size}) one to one")
    return ids


def write_draft_vocab(out_dir: Path, ids: torch.Tensor | None, vocab_size: int) -> None:
    """Writes `d2t.safetensors` for the target ids `ids` of a pruned vocabulary (EAGLE-3's
    convention: target id = draft id + d2t[draft id]; t2d marks the kept target ids), or
    removes a stale one when ids is None."""
    path = Path(out_dir) / D2T_FILE
    path.unlink(missing_ok=True)
    if ids is None:
        return
    ids = ids.cpu().to(torch.int64)
    kept = torch.zeros(vocab_size, dtype=torch.bool)
    kept[ids] = True
    save_file({"d2t": ids - torch.arange(len(ids)), "t2d": kept}, str(path))


def read_tensors(model_dir: Path, names: set[str]) -> dict[str, torch.Tensor]:
    """The named tensors of a safetensors folder, reading nothing else: a draft head needs 2 of
    a target's hundreds of tensors (loader.read_state_dict would read them all)."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise InvalidArgument(f"no *.safetensors files in {model_dir}")
    out: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for key in f.keys():
                if key in names:
                    out[key] = f.get_tensor(key)
    return out


def head_config_for_target(target_dir: Path, *, fc_bias: bool = True, intermediate_size: int | None = None,
                           num_layers: int = 1) -> dict:
    """A public EAGLE config.json for a head sized like the target (its hidden size, heads, vocab
    and rope), in the pre-5.x key style public heads use (rope_theta, rope_scaling)."""
    raw = json.loads((Path(target_dir) / "config.json").read_text())
    heads = raw["num_attention_heads"]
    rope = dict(raw.get("rope_parameters") or {})
    theta = rope.pop("rope_theta", raw.get("rope_theta", 10000.0))
    scaling = raw.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "bias": fc_bias,
        "hidden_act": "silu",
        "hidden_size": raw["hidden_size"],
        "intermediate_size": intermediate_size or raw["intermediate_size"],
        "num_attention_heads": heads,
        "num_key_value_heads": raw.get("num_key_value_heads") or heads,
        "head_dim": raw.get("head_dim") or raw["hidden_size"] // heads,
        "num_hidden_layers": num_layers,
        "rms_norm_eps": raw.get("rms_norm_eps", 1e-6),
        "rope_theta": theta,
        "rope_scaling": scaling,
        "max_position_embeddings": raw.get("max_position_embeddings", 4096),
        "vocab_size": raw["vocab_size"],
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }


def random_eagle_state_dict(config: dict, *, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights for a head config, public key names; matrices scaled 1/sqrt(fan_in) so
    activations stay O(1), norm weights near (not equal to) 1 so a dropped norm shows."""
    d_model, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads") or config["num_attention_heads"]
    head_dim = config.get("head_dim") or d_model // heads
    gen = torch.Generator().manual_seed(seed)

    def mat(out_features: int, in_features: int) -> torch.Tensor:
        return torch.randn(out_features, in_features, generator=gen) * in_features**-0.5

    def vec(size: int, mean: float) -> torch.Tensor:
        return mean + 0.1 * torch.randn(size, generator=gen)

    state = {"fc.weight": mat(d_model, 2 * d_model)}
    if config.get("bias", True):
        state["fc.bias"] = vec(d_model, 0.0)
    for index in range(config.get("num_hidden_layers", 1)):
        p = layer_prefix(index)
        state |= {
            p + "self_attn.q_proj.weight": mat(heads * head_dim, d_model),
            p + "self_attn.k_proj.weight": mat(kv_heads * head_dim, d_model),
            p + "self_attn.v_proj.weight": mat(kv_heads * head_dim, d_model),
            p + "self_attn.o_proj.weight": mat(d_model, heads * head_dim),
            p + "mlp.gate_proj.weight": mat(inter, d_model),
            p + "mlp.up_proj.weight": mat(inter, d_model),
            p + "mlp.down_proj.weight": mat(d_model, inter),
            p + "post_attention_layernorm.weight": vec(d_model, 1.0),
        }
        if index > 0:
            state[p + "input_layernorm.weight"] = vec(d_model, 1.0)
        if config.get("qkv_bias", False):
            for name, width in (("q", heads), ("k", kv_heads), ("v", kv_heads)):
                state[p + f"self_attn.{name}_proj.bias"] = vec(width * head_dim, 0.0)
    return state


def random_eagle_checkpoint(
    out_dir: Path, target_dir: Path, *, seed: int = 0, fc_bias: bool = True, format: str = "bin", num_layers: int = 1
) -> Path:
    """A random-weight EAGLE head sized for the target, written in the public format."""
    config = head_config_for_target(target_dir, fc_bias=fc_bias, num_layers=num_layers)
    return save_eagle_checkpoint(out_dir, config, random_eagle_state_dict(config, seed=seed), format=format)
