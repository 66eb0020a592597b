"""The EAGLE-1/2 draft head (Li et al., SafeAILab/EAGLE `eagle/model/cnets1.py`): Llama decoder
layers (published heads have one) that predict the target's next final-norm hidden state.

Words:
- feature f_i: the target's final-norm hidden state at position i (what LlamaModel.forward
  returns); lm_head(f_i) gives the target's logits for token t_{i+1}.
- pair i: (f_i, t_{i+1}), the feature and the token one position later. The draft's input is
  the target's input shifted left by one token, so the draft KV lags the target's by one.
- predicted feature f^_{i+1}: the head's output for pair i; lm_head(f^_{i+1}) predicts t_{i+2}.

For pair i at position i:  x = fc(cat(embed(t_{i+1}), f_i))   (embedding first, as EAGLE does)
                           h = x + attn(x)                    (no input norm on layer 0: EAGLE skips it)
                           f^_{i+1} = h + mlp(rms_norm(h))    (no final norm)
A head of more layers runs each later one as a whole Llama layer (input norm included) on the
output of the layer before it; the last layer's output is f^_{i+1}. The head shares the
target's embedding and lm_head and keeps its own paged KV cache, one KV layer per decoder layer.
"""

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from tandem.attention.base import AttentionBackend
from tandem.errors import InvalidArgument
from tandem.kv.cache import PagedKVCache
from tandem.models.config import ModelConfig
from tandem.models.eagle_io import layer_prefix, read_draft_vocab, read_eagle_checkpoint, read_tensors, widen_vocab
from tandem.models.kernel_plan import DEFAULT_PLAN, KernelPlan
from tandem.models.linear import Int8Linear, Linear, choose_kernels, make_head_projection, with_plan
from tandem.models.llama import ForwardBatch, LayerWeights, attention_block, mlp_block, rms_norm
from tandem.models.rope import inverse_frequencies, rope_tables, signed_sin


@dataclass(frozen=True, slots=True)
class EagleConfig:
    """The head's architecture, from its config.json."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    fc_bias: bool  # config "bias", default true as in EAGLE
    qkv_bias: bool  # config "qkv_bias" (EAGLE heads of Qwen2 targets)
    num_layers: int = 1  # config "num_hidden_layers"; layers after the first apply their input norm

    @staticmethod
    def from_dict(raw: dict) -> "EagleConfig":
        layers = raw.get("num_hidden_layers", 1)
        if not isinstance(layers, int) or isinstance(layers, bool) or layers < 1:
            raise InvalidArgument(f"EAGLE head config num_hidden_layers is {layers!r}; it must be 1 or more")
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise InvalidArgument(f"EAGLE head config hidden_act is {act!r}; only 'silu' is supported")
        heads = raw["num_attention_heads"]
        return EagleConfig(
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_heads=heads,
            num_kv_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            max_position_embeddings=raw.get("max_position_embeddings", 4096),
            fc_bias=bool(raw.get("bias", True)),
            qkv_bias=bool(raw.get("qkv_bias", False)),
            num_layers=layers,
        )

    def model_config(self) -> ModelConfig:
        """The view our attention code and KV-cache sizing read: the head's layers, no sliding window."""
        return ModelConfig(
            architecture="llama",
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_layers=self.num_layers,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps,
            max_position_embeddings=self.max_position_embeddings,
            tie_word_embeddings=False,
            attention_bias=self.qkv_bias,
            sliding_window=None,
            eos_token_ids=(),
            torch_dtype="float32",
        )


class EagleHead:
    """Projections in nn.Linear's [out, in] layout (tandem.models.linear), int8 or in the head's
    dtype; layer 0's `input_norm` is never read (EAGLE's first layer has none)."""

    def __init__(
        self,
        config: EagleConfig,
        fc: Linear | Int8Linear,  # 2D -> D: inputs 0..D-1 take the embedding, D..2D-1 the feature
        layers: list[LayerWeights],
        embed: torch.Tensor,  # [V, D], the target's
        lm_head: Linear | Int8Linear,  # D -> V': the target's over the draft vocabulary (scoring_projection)
        rope_cos: torch.Tensor,  # [max_positions, head_dim] fp32
        rope_sin: torch.Tensor,
        backend: AttentionBackend,
        vocab_ids: torch.Tensor | None = None,  # [V'] int64: a pruned draft vocabulary (d2t)
        kernels: KernelPlan = DEFAULT_PLAN,  # the CPU kernel of every projection for each row count
    ):
        d = config.hidden_size
        assert fc.weight.shape == (d, 2 * d), fc.weight.shape
        assert embed.shape[1] == d and lm_head.weight.shape[1] == d, (embed.shape, lm_head.weight.shape)
        self.config, self.kernels = config, kernels
        self.fc, self.layers = with_plan(fc, kernels), [layer.with_kernels(kernels) for layer in layers]
        self.embed, self.vocab_size = embed, embed.shape[0]
        self.vocab_ids = vocab_ids
        self.lm_head = with_plan(lm_head, kernels)
        self.dtype = layers[0].post_norm.dtype  # the head's compute dtype (int8 projections' too)
        self.rope_cos = rope_cos.to(self.dtype)
        self.rope_sin = signed_sin(rope_sin).to(self.dtype)
        self.backend = backend
        self._model_config = config.model_config()
        self.feature_layers: tuple[int, ...] = ()  # it reads the target's final-norm hidden state
        self.feature_width = config.hidden_size

    @property
    def model_config(self) -> ModelConfig:
        return self._model_config

    @torch.inference_mode()
    def forward(
        self,
        tokens: torch.Tensor,  # [T] int64: t_{i+1} of each packed pair
        features: torch.Tensor,  # [T, D]: f_i (any float dtype; cast to the head's)
        batch: ForwardBatch,  # positions i, slot_mapping, plan; batch.input_ids is not read
        cache: PagedKVCache,  # the head's own, one KV layer per decoder layer
    ) -> torch.Tensor:  # [T, D]: the predicted features f^_{i+1}
        assert tokens.shape[0] == features.shape[0] == batch.positions.shape[0], (tokens.shape, features.shape)
        x = torch.cat((F.embedding(tokens, self.embed), features.to(self.dtype)), dim=-1)
        h = self.fc(x)
        cos, sin = self.rope_cos[batch.positions], self.rope_sin[batch.positions]
        eps = self.config.rms_norm_eps
        for index, layer in enumerate(self.layers):
            x = h if index == 0 else rms_norm(h, layer.input_norm, eps)
            h = h + attention_block(self._model_config, index, layer, x, cos, sin, batch, cache, self.backend)
            h = h + mlp_block(layer, rms_norm(h, layer.post_norm, eps))
        return h

    @torch.inference_mode()
    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """features [S, D] (predicted, no norm applied) -> logits [S, V] in fp32."""
        return self.widen(self.scores(features))

    @torch.inference_mode()
    def scores(self, features: torch.Tensor) -> torch.Tensor:
        """features [S, D] -> the draft vocabulary's logits [S, V'] in fp32: column j scores token
        vocab_ids[j] (token j without a pruned vocabulary, V' = V)."""
        return self.lm_head(features).float()

    def widen(self, scores: torch.Tensor) -> torch.Tensor:
        """scores [S, V'] -> logits [S, V], -inf outside the draft vocabulary."""
        return widen_vocab(scores, self.vocab_ids, self.vocab_size)


def build_head_weights(
    config: EagleConfig, state: dict[str, torch.Tensor], dtype: torch.dtype, device, int8: bool = False
) -> tuple[Linear | Int8Linear, list[LayerWeights]]:
    """(fc, layers) from a public state dict; checks every key and shape. int8: the projections
    hold int8 weights, one scale per row (CPU; tandem.models.linear.Int8Linear), norms and
    biases stay in `dtype`."""
    if "d2t" in state or any(k.startswith("midlayer.") for k in state):
        raise InvalidArgument("this is an EAGLE-3 checkpoint (midlayer / d2t keys): tandem.models.eagle3 loads it")
    expected = _expected_shapes(config)
    extra = sorted({k.split(".")[1] for k in state if k.startswith("layers.")} - {str(j) for j in range(config.num_layers)})
    if extra:
        raise InvalidArgument(f"EAGLE checkpoint holds weights of layers {', '.join(extra)}; its config's "
                              f"num_hidden_layers is {config.num_layers}")

    def take(name: str) -> torch.Tensor:
        if name not in state:
            raise InvalidArgument(f"EAGLE checkpoint lacks weight {name}")
        w = state[name]
        if tuple(w.shape) != expected[name]:
            raise InvalidArgument(f"EAGLE weight {name} has shape {list(w.shape)}, config wants {list(expected[name])}")
        return w.to(device=device, dtype=dtype)

    project = lambda weight, bias=None: make_head_projection(weight, int8, bias)  # noqa: E731

    def layer(index: int) -> LayerWeights:
        p = layer_prefix(index)
        qkv_bias = torch.cat([take(p + f"self_attn.{n}_proj.bias") for n in "qkv"]) if config.qkv_bias else None
        return LayerWeights(
            input_norm=(torch.ones(config.hidden_size, dtype=dtype, device=device) if index == 0  # unused
                        else take(p + "input_layernorm.weight").contiguous()),
            qkv=project(torch.cat([take(p + f"self_attn.{n}_proj.weight") for n in "qkv"]), qkv_bias),
            o=project(take(p + "self_attn.o_proj.weight")),
            post_norm=take(p + "post_attention_layernorm.weight").contiguous(),
            gate_up=project(torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")])),
            down=project(take(p + "mlp.down_proj.weight")),
        )

    fc = project(take("fc.weight"), take("fc.bias") if config.fc_bias else None)
    return fc, [layer(index) for index in range(config.num_layers)]


def _expected_shapes(c: EagleConfig) -> dict[str, tuple[int, ...]]:
    d, q, kv = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    shapes = {"fc.weight": (d, 2 * d), "fc.bias": (d,)}
    for index in range(c.num_layers):
        p = layer_prefix(index)
        shapes |= {
            p + "self_attn.q_proj.weight": (q, d),
            p + "self_attn.k_proj.weight": (kv, d),
            p + "self_attn.v_proj.weight": (kv, d),
            p + "self_attn.q_proj.bias": (q,),
            p + "self_attn.k_proj.bias": (kv,),
            p + "self_attn.v_proj.bias": (kv,),
            p + "self_attn.o_proj.weight": (d, q),
            p + "mlp.gate_proj.weight": (c.intermediate_size, d),
            p + "mlp.up_proj.weight": (c.intermediate_size, d),
            p + "mlp.down_proj.weight": (d, c.intermediate_size),
            p + "input_layernorm.weight": (d,),
            p + "post_attention_layernorm.weight": (d,),
        }
    return shapes


def load_eagle_head(
    head_dir: Path,
    target_dir: Path,
    *,
    dtype: torch.dtype,
    backend: AttentionBackend,
    device: torch.device | str = "cpu",
    max_positions: int | None = None,
    lm_head_int8: bool = False,
    head_int8: bool = False,
    kernels: KernelPlan | None = None,
) -> EagleHead:
    """The head of `head_dir` (public EAGLE-1/2 format) with the embedding and lm_head of the
    target in `target_dir` (a safetensors folder, tied or not); rope from the head's config.
    lm_head_int8 / head_int8: the (pruned) lm_head / the head's own projections (fc and its
    decoder layers) with int8 weights (CPU). kernels: the CPU kernel plan (--cpu-kernels);
    None: timed on CPU (draft_kernels)."""
    raw, state = read_eagle_checkpoint(head_dir)
    config = EagleConfig.from_dict(raw)
    target = ModelConfig.from_folder(target_dir)
    if config.hidden_size != target.hidden_size:
        raise InvalidArgument(
            f"EAGLE head hidden_size {config.hidden_size} does not match the target's {target.hidden_size}"
        )
    if config.vocab_size != target.vocab_size:
        raise InvalidArgument(
            f"EAGLE head vocab_size {config.vocab_size} does not match the target's {target.vocab_size}"
        )
    fc, layers = build_head_weights(config, state, dtype, device, head_int8)
    embed, lm_head = target_embeddings(target, Path(target_dir), dtype, device)
    inv_freq, scaling = head_rope(Path(head_dir), raw)
    cos, sin = rope_tables(inv_freq, scaling, max_positions or config.max_position_embeddings)
    vocab_ids = read_draft_vocab(Path(head_dir), config.vocab_size, device)
    scoring = scoring_projection(lm_head, vocab_ids, lm_head_int8)
    plan = draft_kernels(kernels, device, [fc] + [p for layer in layers for p in layer.projections()], scoring)
    return EagleHead(config, fc, layers, embed, scoring, cos.to(device), sin.to(device), backend, vocab_ids, plan)


def scoring_projection(lm_head: torch.Tensor, vocab_ids: torch.Tensor | None, int8: bool) -> Linear | Int8Linear:
    """lm_head [V, D] (the target's) -> the draft's scoring projection, int8 (CPU) or not. A
    pruned vocabulary scores only its tokens (EAGLE-3's d2t): a smaller lm_head, and the rest of
    the vocabulary at -inf (widen_vocab), so the draft never proposes what it was not trained on."""
    return make_head_projection(lm_head if vocab_ids is None else lm_head[vocab_ids], int8)


def draft_kernels(given: KernelPlan | None, device, projections: list, lm_head) -> KernelPlan:
    """`given`, else on CPU the plan timed on the draft's own projections, its small weights
    (those not in int8), else on its lm_head (tandem.models.linear.choose_kernels)."""
    own = [p for p in projections if isinstance(p, Linear)]
    return choose_kernels(given, device, own or [p for p in (lm_head,) if isinstance(p, Linear)])


def target_embeddings(target: ModelConfig, target_dir: Path, dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(embed [V, D], lm_head [V, D]) of the target, tied or not (the loader's rule)."""
    embed_key, head_key = "model.embed_tokens.weight", "lm_head.weight"
    found = read_tensors(target_dir, {embed_key, head_key})
    if embed_key not in found:
        raise InvalidArgument(f"target checkpoint {target_dir} lacks weight {embed_key}")
    embed = found[embed_key].to(device=device, dtype=dtype).contiguous()
    tied = target.tie_word_embeddings or head_key not in found
    head = embed if tied else found[head_key].to(device=device, dtype=dtype)
    return embed, head.contiguous()


def head_rope(head_dir: Path, raw: dict) -> tuple[torch.Tensor, float]:
    """The head's rope through tandem.models.rope; a config AutoConfig cannot place (no
    model_type, as some EAGLE configs have) is read as a Llama config."""
    if raw.get("model_type"):
        return inverse_frequencies(head_dir)
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps({**raw, "model_type": "llama"}))
        return inverse_frequencies(Path(tmp))
