"""The EAGLE-3 draft head (Li et al. 2025; SafeAILab/EAGLE `eagle/model/cnets.py`, vLLM
`llama_eagle3.py`): one Llama decoder layer that reads the target's low, middle and high layers
and ranks its own (usually pruned) vocabulary.

Words, beside tandem.models.eagle's:
- aux layers: the target layers whose inputs (the residual stream entering each, before its
  norm) the head reads, in ascending order (EAGLE-3 and vLLM gather them as the forward pass
  reaches them, whatever order a config lists); config `eagle_aux_hidden_state_layer_ids`
  (also under `eagle_config`), by default 2, L/2 and L-3 of the target's L layers.
- fused feature g_i = fc(cat(a_i^1, ..., a_i^n)): the aux layers' inputs at position i, side by
  side, projected to D (no bias). Draft steps feed back the head's own output h^ as g.

For pair i at position i:  x  = cat(input_norm(embed(t_{i+1})), hidden_norm(g_i))   [2D]
                           h  = g_i + attn(x)                  (q, k, v read 2D columns)
                           h^ = h + mlp(post_norm(h))
                           logits = lm_head(norm(h^))          (the head's own lm_head and norm)
`norm_before_residual` heads add hidden_norm(g_i) instead of g_i. The draft vocabulary maps to
the target's by `d2t` in the checkpoint (target id = draft id + d2t[draft id]).

Checkpoint keys ([out, in] as nn.Linear): fc.weight [D, nD]; midlayer.{input_layernorm,
hidden_norm,post_attention_layernorm}.weight; midlayer.self_attn.{q,k,v}_proj.weight [*, 2D];
midlayer.self_attn.o_proj.weight; midlayer.mlp.{gate,up,down}_proj.weight; norm.weight;
lm_head.weight [V', D]; d2t [V'] (unless V' is the target's vocabulary). t2d and
embed_tokens.weight may be present and are not read: the head embeds with the target's table.
"""

import json
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open

from tandem.attention.base import AttentionBackend
from tandem.errors import InvalidArgument
from tandem.kv.cache import PagedKVCache
from tandem.models.config import ModelConfig
from tandem.models.eagle import EagleConfig, draft_kernels, head_rope
from tandem.models.eagle_io import (WEIGHT_FILES, head_config_for_target, read_eagle_checkpoint, read_tensors,
                                    vocab_ids_from_d2t, widen_vocab)
from tandem.models.kernel_plan import DEFAULT_PLAN, KernelPlan
from tandem.models.linear import Int8Linear, Linear, make_head_projection, with_plan
from tandem.models.llama import ForwardBatch, LayerWeights, attention_block, mlp_block, rms_norm
from tandem.models.rope import rope_tables, signed_sin

LAYER = "midlayer."
ARCHITECTURE = "LlamaForCausalLMEagle3"


def is_eagle3(raw: dict, state: dict) -> bool:
    """Whether a head folder's config and weights are EAGLE-3's."""
    return ARCHITECTURE in (raw.get("architectures") or ()) or any(k.startswith(LAYER) for k in state)


def is_eagle3_folder(head_dir: Path) -> bool:
    """is_eagle3 of a head folder, reading its config and weight names only."""
    raw = json.loads((Path(head_dir) / "config.json").read_text()) if (Path(head_dir) / "config.json").is_file() else {}
    if ARCHITECTURE in (raw.get("architectures") or ()):
        return True
    bin_path, st_path = Path(head_dir) / WEIGHT_FILES["bin"], Path(head_dir) / WEIGHT_FILES["safetensors"]
    if bin_path.is_file():
        names = torch.load(bin_path, map_location="cpu", weights_only=True, mmap=True).keys()
    elif st_path.is_file():
        with safe_open(str(st_path), framework="pt") as f:
            names = list(f.keys())
    else:
        return False  # the loader names what is missing
    return is_eagle3(raw, dict.fromkeys(names))


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's 2, L/2 and L-3; fewer for a target of under 6 layers (tiny test models), whose
    clamped picks coincide."""
    return tuple(sorted({min(max(i, 0), num_layers - 1) for i in (2, num_layers // 2, num_layers - 3)}))


def aux_layers_of(raw: dict, num_layers: int) -> tuple[int, ...]:
    """The aux layers of an EAGLE-3 config for a target of `num_layers` layers; InvalidArgument
    unless they are distinct layers of the target in ascending order (the order the head reads)."""
    aux = raw.get("eagle_aux_hidden_state_layer_ids") or (raw.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids") or default_aux_layers(num_layers)
    if not all(isinstance(i, int) and 0 <= i < num_layers for i in aux) or list(aux) != sorted(set(aux)):
        raise InvalidArgument(f"EAGLE-3 head aux layers {list(aux)} are not distinct layers of the target "
                              f"(0..{num_layers - 1}) in ascending order")
    if len(aux) < 2:  # one layer's features are as wide as the head's own: fc could not tell them apart
        raise InvalidArgument(f"EAGLE-3 head aux layers {list(aux)}: it fuses at least 2 target layers")
    return tuple(aux)


@dataclass(frozen=True, slots=True)
class Eagle3Config:
    layer: EagleConfig  # the decoder layer's shapes; its vocab_size is the target's
    draft_vocab_size: int
    aux_layers: tuple[int, ...]
    norm_before_residual: bool = False

    @staticmethod
    def from_dict(raw: dict, target: ModelConfig) -> "Eagle3Config":
        layer = EagleConfig.from_dict(raw)
        if layer.num_layers != 1:
            raise InvalidArgument(f"EAGLE-3 head config num_hidden_layers is {layer.num_layers}; only 1 is supported")
        if target.hidden_size != layer.hidden_size or raw.get("target_hidden_size", layer.hidden_size) != layer.hidden_size:
            raise InvalidArgument(f"EAGLE-3 head hidden_size {layer.hidden_size} (target_hidden_size "
                                  f"{raw.get('target_hidden_size')}) does not match the target's {target.hidden_size}")
        return Eagle3Config(layer=layer, draft_vocab_size=int(raw.get("draft_vocab_size") or layer.vocab_size),
                            aux_layers=aux_layers_of(raw, target.num_layers),
                            norm_before_residual=bool(raw.get("norm_before_residual", False)))

    @property
    def hidden_size(self) -> int:
        return self.layer.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.layer.vocab_size


@dataclass(frozen=True, slots=True)
class Eagle3Weights:
    fc: Linear | Int8Linear  # nD -> D
    layer: LayerWeights  # input_norm normalises the embedding; qkv reads 2D
    hidden_norm: torch.Tensor  # [D]
    norm: torch.Tensor  # [D], before the lm_head
    lm_head: torch.Tensor  # [V', D]


class Eagle3Head:
    """Serves as tandem.models.eagle.EagleHead does (forward, scores, widen, logits); its
    `forward` fuses the features as wide as fc's input (the target's), and takes narrower ones
    (its own outputs, fed back on draft steps) as they are."""

    def __init__(self, config: Eagle3Config, weights: Eagle3Weights, embed: torch.Tensor,
                 lm_head: Linear | Int8Linear,  # D -> V': weights.lm_head, int8 (CPU) or not
                 rope_cos: torch.Tensor, rope_sin: torch.Tensor, backend: AttentionBackend,
                 vocab_ids: torch.Tensor | None = None, kernels: KernelPlan = DEFAULT_PLAN):
        self.config, self.kernels = config, kernels
        self.weights = replace(weights, fc=with_plan(weights.fc, kernels), layer=weights.layer.with_kernels(kernels))
        self.embed, self.vocab_size = embed, config.vocab_size
        self.vocab_ids = vocab_ids
        self.lm_head = with_plan(lm_head, kernels)
        self.dtype = weights.norm.dtype
        self.rope_cos = rope_cos.to(self.dtype)
        self.rope_sin = signed_sin(rope_sin).to(self.dtype)
        self.backend = backend
        self.feature_layers = config.aux_layers
        self.feature_width = len(config.aux_layers) * config.hidden_size
        self.model_config = config.layer.model_config()

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, features: torch.Tensor, batch: ForwardBatch,
                cache: PagedKVCache) -> torch.Tensor:
        """tokens [T]: t_{i+1}; features [T, nD] (the target's aux layers) or [T, D] (the head's
        own outputs); returns h^ [T, D]."""
        c, w = self.config, self.weights
        eps = c.layer.rms_norm_eps
        g = features.to(self.dtype)
        if g.shape[-1] != c.hidden_size:
            g = w.fc(g)
        normed = rms_norm(g, w.hidden_norm, eps)
        x = torch.cat((rms_norm(F.embedding(tokens, self.embed), w.layer.input_norm, eps), normed), dim=-1)
        cos, sin = self.rope_cos[batch.positions], self.rope_sin[batch.positions]
        residual = normed if c.norm_before_residual else g
        h = residual + attention_block(self.model_config, 0, w.layer, x, cos, sin, batch, cache, self.backend)
        return h + mlp_block(w.layer, rms_norm(h, w.layer.post_norm, eps))

    @torch.inference_mode()
    def scores(self, features: torch.Tensor) -> torch.Tensor:
        """h^ [S, D] -> the draft vocabulary's logits [S, V'] in fp32 (column j: vocab_ids[j])."""
        return self.lm_head(rms_norm(features, self.weights.norm, self.config.layer.rms_norm_eps)).float()

    def widen(self, scores: torch.Tensor) -> torch.Tensor:
        return widen_vocab(scores, self.vocab_ids, self.vocab_size)

    @torch.inference_mode()
    def logits(self, features: torch.Tensor) -> torch.Tensor:
        return self.widen(self.scores(features))


def expected_shapes(c: Eagle3Config) -> dict[str, tuple[int, ...]]:
    d, lc = c.hidden_size, c.layer
    q, kv = lc.num_heads * lc.head_dim, lc.num_kv_heads * lc.head_dim
    return {
        "fc.weight": (d, len(c.aux_layers) * d),
        LAYER + "self_attn.q_proj.weight": (q, 2 * d),
        LAYER + "self_attn.k_proj.weight": (kv, 2 * d),
        LAYER + "self_attn.v_proj.weight": (kv, 2 * d),
        LAYER + "self_attn.o_proj.weight": (d, q),
        LAYER + "mlp.gate_proj.weight": (lc.intermediate_size, d),
        LAYER + "mlp.up_proj.weight": (lc.intermediate_size, d),
        LAYER + "mlp.down_proj.weight": (d, lc.intermediate_size),
        LAYER + "input_layernorm.weight": (d,),
        LAYER + "hidden_norm.weight": (d,),
        LAYER + "post_attention_layernorm.weight": (d,),
        "norm.weight": (d,),
        "lm_head.weight": (c.draft_vocab_size, d),
    }


def build_eagle3_weights(c: Eagle3Config, state: dict[str, torch.Tensor], dtype: torch.dtype, device,
                         int8: bool = False) -> Eagle3Weights:
    """The head's weights from a public state dict; every key and shape checked. int8: the
    projections hold int8 weights (CPU), norms stay in `dtype`."""
    expected = expected_shapes(c)
    if c.layer.qkv_bias:
        raise InvalidArgument("EAGLE-3 head config asks for qkv_bias, which EAGLE-3 heads do not have")

    def take(name: str) -> torch.Tensor:
        if name not in state:
            raise InvalidArgument(f"EAGLE-3 checkpoint lacks weight {name}")
        if tuple(state[name].shape) != expected[name]:
            raise InvalidArgument(f"EAGLE-3 weight {name} has shape {list(state[name].shape)}, "
                                  f"config wants {list(expected[name])}")
        return state[name].to(device=device, dtype=dtype).contiguous()

    project = lambda name: make_head_projection(take(name), int8)  # noqa: E731
    attn = LAYER + "self_attn."
    qkv = torch.cat([take(attn + f"{n}_proj.weight") for n in "qkv"])
    layer = LayerWeights(
        input_norm=take(LAYER + "input_layernorm.weight"),
        qkv=make_head_projection(qkv, int8),
        o=project(attn + "o_proj.weight"),
        post_norm=take(LAYER + "post_attention_layernorm.weight"),
        gate_up=make_head_projection(torch.cat([take(LAYER + f"mlp.{n}_proj.weight") for n in ("gate", "up")]), int8),
        down=project(LAYER + "mlp.down_proj.weight"),
    )
    return Eagle3Weights(fc=project("fc.weight"), layer=layer, hidden_norm=take(LAYER + "hidden_norm.weight"),
                         norm=take("norm.weight"), lm_head=take("lm_head.weight"))


def draft_vocab(c: Eagle3Config, state: dict[str, torch.Tensor], device) -> torch.Tensor | None:
    """The target ids of the draft vocabulary (from d2t), or None when it is the target's."""
    if "d2t" not in state:
        if c.draft_vocab_size != c.vocab_size:
            raise InvalidArgument(f"EAGLE-3 checkpoint lacks d2t, which maps its {c.draft_vocab_size} draft tokens "
                                  f"into the target's {c.vocab_size}")
        return None
    if tuple(state["d2t"].shape) != (c.draft_vocab_size,):
        raise InvalidArgument(f"EAGLE-3 d2t has shape {list(state['d2t'].shape)}, config wants [{c.draft_vocab_size}]")
    return vocab_ids_from_d2t(state["d2t"], c.vocab_size, "EAGLE-3 checkpoint").to(device)


def load_eagle3_head(head_dir: Path, target_dir: Path, *, dtype: torch.dtype, backend: AttentionBackend,
                     device: torch.device | str = "cpu", max_positions: int | None = None,
                     lm_head_int8: bool = False, head_int8: bool = False,
                     kernels: KernelPlan | None = None) -> Eagle3Head:
    """The EAGLE-3 head of `head_dir` with the embedding of the target in `target_dir`;
    kernels: the CPU kernel plan (--cpu-kernels), None: timed on CPU (eagle.draft_kernels)."""
    raw, state = read_eagle_checkpoint(head_dir)
    target = ModelConfig.from_folder(target_dir)
    config = Eagle3Config.from_dict(raw, target)
    if config.vocab_size != target.vocab_size:
        raise InvalidArgument(f"EAGLE-3 head vocab_size {config.vocab_size} does not match the target's "
                              f"{target.vocab_size}")
    weights = build_eagle3_weights(config, state, dtype, device, head_int8)
    embed = target_embed(Path(target_dir), dtype, device)
    inv_freq, scaling = head_rope(Path(head_dir), raw)
    cos, sin = rope_tables(inv_freq, scaling, max_positions or config.layer.max_position_embeddings)
    lm_head = make_head_projection(weights.lm_head, lm_head_int8)
    plan = draft_kernels(kernels, device, [weights.fc, *weights.layer.projections()], lm_head)
    return Eagle3Head(config, weights, embed, lm_head, cos.to(device), sin.to(device), backend,
                      draft_vocab(config, state, device), plan)


def target_embed(target_dir: Path, dtype, device) -> torch.Tensor:
    """The target's embedding alone: an EAGLE-3 head has its own lm_head."""
    key = "model.embed_tokens.weight"
    found = read_tensors(target_dir, {key})
    if key not in found:
        raise InvalidArgument(f"target checkpoint {target_dir} lacks weight {key}")
    return found[key].to(device=device, dtype=dtype).contiguous()


def eagle3_config_for_target(target_dir: Path, *, draft_vocab_size: int | None = None,
                             aux_layers: tuple[int, ...] | None = None) -> dict:
    """A public EAGLE-3 config.json for a head sized like the target; aux layers written out."""
    raw = head_config_for_target(target_dir)
    target = ModelConfig.from_folder(target_dir)
    del raw["bias"]  # EAGLE-3's fc has none
    return raw | {"architectures": [ARCHITECTURE], "draft_vocab_size": draft_vocab_size or raw["vocab_size"],
                  "eagle_aux_hidden_state_layer_ids": list(aux_layers or default_aux_layers(target.num_layers))}
