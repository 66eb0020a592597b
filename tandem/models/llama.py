"""The Llama-family decoder (Llama, Mistral, Qwen2): RMSNorm, RoPE, grouped-query attention,
SwiGLU, optionally tied embeddings. Works on a packed batch of tokens from many sequences;
attention goes through an AttentionBackend over a paged KV cache.

q/k/v and gate/up projections are fused into one matrix each: fewer, larger matmuls per layer,
which is what a memory-bound decode step wants. Weights keep nn.Linear's [out, in] layout;
`tandem.models.linear` picks the CPU kernel by row count (one row for a decode step, a few for a
verify step).
"""

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from tandem.attention.base import AttentionBackend
from tandem.kv.cache import PagedKVCache
from tandem.models.config import ModelConfig
from tandem.models.kernel_plan import DEFAULT_PLAN, KernelPlan
from tandem.models.linear import Linear, with_plan
from tandem.models.rope import apply_rope, signed_sin


@dataclass(frozen=True, slots=True)
class LayerWeights:
    input_norm: torch.Tensor  # [D]
    qkv: Linear  # D -> (H + 2 * KVH) * d, with the q/k/v biases where the model has them
    o: Linear  # H * d -> D
    post_norm: torch.Tensor  # [D]
    gate_up: Linear  # D -> 2 * I
    down: Linear  # I -> D

    def projections(self) -> list[Linear]:
        return [self.qkv, self.o, self.gate_up, self.down]

    def with_kernels(self, plan: KernelPlan) -> "LayerWeights":
        """The same weights, their projections running `plan`'s CPU kernels."""
        return replace(self, qkv=with_plan(self.qkv, plan), o=with_plan(self.o, plan),
                       gate_up=with_plan(self.gate_up, plan), down=with_plan(self.down, plan))


@dataclass(frozen=True, slots=True)
class ModelWeights:
    embed: torch.Tensor  # [V, D]
    layers: tuple[LayerWeights, ...]
    norm: torch.Tensor  # [D]
    lm_head: Linear  # D -> V (over embed itself when tied)

    def projections(self) -> list[Linear]:
        """Every projection of a forward pass, in its order."""
        return [p for layer in self.layers for p in layer.projections()] + [self.lm_head]

    def with_kernels(self, plan: KernelPlan) -> "ModelWeights":
        return replace(self, layers=tuple(layer.with_kernels(plan) for layer in self.layers),
                       lm_head=with_plan(self.lm_head, plan))


@dataclass(frozen=True, slots=True)
class ForwardBatch:
    """Everything one forward pass needs besides the weights; built once per step."""

    input_ids: torch.Tensor  # [T] int64, packed over sequences
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64: KV slot each token is written to
    plan: object  # the attention backend's metadata for this batch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32:  # one fused op; each op costs ~5 us of dispatch on CPU
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    # Lower precision: normalise in fp32, cast back before the weight, as the reference does.
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


class LlamaModel:
    def __init__(
        self,
        config: ModelConfig,
        weights: ModelWeights,
        rope_cos: torch.Tensor,  # [max_positions, head_dim] fp32
        rope_sin: torch.Tensor,
        backend: AttentionBackend,
        kernels: KernelPlan = DEFAULT_PLAN,  # the CPU kernel of every projection for each row count
    ):
        self.config = config
        self.kernels = kernels
        self.weights = weights.with_kernels(kernels)
        self.dtype = weights.embed.dtype
        self.rope_cos = rope_cos.to(self.dtype)
        self.rope_sin = signed_sin(rope_sin).to(self.dtype)
        self.backend = backend

    @torch.inference_mode()
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] -> token embeddings [T, D]."""
        return F.embedding(input_ids, self.weights.embed)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, cache: PagedKVCache, embeds: torch.Tensor | None = None,
                capture: tuple[int, ...] = ()) -> torch.Tensor:
        """Returns the final-norm hidden states [T, D] of every packed token; `embeds` [T, D]:
        the tokens' embeddings when the caller ran embed() itself. With `capture` (layer ids, an
        EAGLE-3 head's aux layers) it returns [T, D * (1 + len(capture))]: the final-norm hidden
        states, then the residual stream entering each captured layer, in capture's order (one
        tensor, so that a CUDA graph can hold it)."""
        w = self.weights
        h = self.embed(batch.input_ids) if embeds is None else embeds
        cos = self.rope_cos[batch.positions]
        sin = self.rope_sin[batch.positions]
        eps = self.config.rms_norm_eps
        captured = {}
        for index, layer in enumerate(w.layers):
            if index in capture:
                captured[index] = h
            x = rms_norm(h, layer.input_norm, eps)
            h = h + attention_block(self.config, index, layer, x, cos, sin, batch, cache, self.backend)
            h = h + mlp_block(layer, rms_norm(h, layer.post_norm, eps))
        out = rms_norm(h, w.norm, self.config.rms_norm_eps)
        return torch.cat([out, *(captured[i] for i in capture)], dim=-1) if capture else out

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [S, D] (final-norm) -> logits [S, V] in fp32."""
        return self.weights.lm_head(hidden).float()


def attention_block(config: ModelConfig, index: int, layer: LayerWeights, x, cos, sin, batch: ForwardBatch,
                    cache: PagedKVCache, backend: AttentionBackend) -> torch.Tensor:
    """Self-attention of one decoder layer over x [T, D] (already normed); KV layer `index`."""
    c = config
    tokens = x.shape[0]
    qkv = layer.qkv(x)
    # Rotary on q and k at once: they are adjacent columns of the fused projection.
    qk_width = (c.num_heads + c.num_kv_heads) * c.head_dim
    qk = apply_rope(qkv[:, :qk_width].view(tokens, c.num_heads + c.num_kv_heads, c.head_dim), cos, sin)
    q, k = qk[:, : c.num_heads], qk[:, c.num_heads :]
    v = qkv[:, qk_width:].view(tokens, c.num_kv_heads, c.head_dim)
    out = backend.forward(index, q, k, v, cache, batch.slot_mapping, batch.plan, c.head_dim**-0.5)
    return layer.o(out.reshape(tokens, c.num_heads * c.head_dim))


def mlp_block(layer: LayerWeights, x: torch.Tensor) -> torch.Tensor:
    gate, up = layer.gate_up(x).chunk(2, dim=-1)
    return layer.down(F.silu(gate) * up)
