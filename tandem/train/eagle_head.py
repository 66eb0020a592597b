"""A trainable EAGLE-1 head (the architecture of tandem.models.eagle, in nn.Linear's [out, in]
layout) run over whole sequences, with EAGLE-3's training-time test (TTT).

Step 0 is EAGLE-1's teacher forcing: anchor i feeds the pair (f_i, t_{i+1}) at position i and
predicts f^_{i+1}, whose logits predict t_{i+2}. Step s > 0 feeds (f^_{i+s}, t_{i+s+1}) at
position i+s: the head's own predicted feature from step s - 1, as a drafted chain does at
serve time. Its query attends to the true pairs 0..i (step 0's keys, causally) and to anchor
i's own chain nodes of steps 1..s (one key each: the diagonal of each step), exactly the draft
KV of a chain of depth s from anchor i. The token inputs are the true ones: a chain that
drafted a wrong token is rejected there, so later steps only matter when they are right.
"""

import torch
import torch.nn.functional as F
from torch import nn

from tandem.errors import InvalidArgument
from tandem.models.eagle_io import layer_prefix
from tandem.train.losses import shifted


class DraftLayer(nn.Module):
    """One Llama decoder layer of the head. Layer 0 has no input norm (EAGLE's cnets1 skips it:
    fc's output goes straight into attention); later layers apply theirs. in_width: what q, k
    and v read when the caller hands attention its own input (EAGLE-3: embedding and feature,
    2D); the residual stream stays D wide."""

    def __init__(self, config: dict, index: int, in_width: int | None = None):
        super().__init__()
        d, inter = config["hidden_size"], config["intermediate_size"]
        self.heads, self.kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
        self.head_dim, self.eps = config["head_dim"], config["rms_norm_eps"]
        width = in_width or d
        self.q_proj = nn.Linear(width, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(width, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(width, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, d, bias=False)
        self.gate_proj = nn.Linear(d, inter, bias=False)
        self.up_proj = nn.Linear(d, inter, bias=False)
        self.down_proj = nn.Linear(inter, d, bias=False)
        self.post_norm = nn.Parameter(torch.ones(d))
        self.input_norm = nn.Parameter(torch.ones(d)) if index > 0 else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, keys: list, values: list,
                attn_input: torch.Tensor | None = None) -> torch.Tensor:
        """x [N, L, D] (the residual stream) at the positions of cos/sin; appends this step's
        keys and values (the layer's KV) and attends to all of them. attn_input [N, L, in_width]:
        what q, k and v read instead of x (after its input norm, if any)."""
        n, length, _ = x.shape
        if attn_input is not None:
            a = attn_input
        else:
            a = x if self.input_norm is None else F.rms_norm(x, (x.shape[-1],), self.input_norm.to(x.dtype), self.eps)

        def heads(t, count, rope):
            t = t.view(n, length, count, self.head_dim).transpose(1, 2)
            if not rope:
                return t
            half = self.head_dim // 2
            return t * cos.to(t.dtype) + torch.cat((-t[..., half:], t[..., :half]), dim=-1) * sin.to(t.dtype)

        keys.append(heads(self.k_proj(a), self.kv_heads, True))
        values.append(heads(self.v_proj(a), self.kv_heads, False))
        attended = _attend(heads(self.q_proj(a), self.heads, True), keys, values)
        h = x + self.o_proj(attended.transpose(1, 2).reshape(n, length, -1))
        normed = F.rms_norm(h, (h.shape[-1],), self.post_norm.to(h.dtype), self.eps)
        return h + self.down_proj(F.silu(self.gate_proj(normed)) * self.up_proj(normed))

    def public_params(self, prefix: str) -> dict[str, nn.Parameter]:
        state = {prefix + "post_attention_layernorm.weight": self.post_norm}
        if self.input_norm is not None:
            state[prefix + "input_layernorm.weight"] = self.input_norm
        for name in "qkvo":
            state[prefix + f"self_attn.{name}_proj.weight"] = getattr(self, f"{name}_proj").weight
        for name in ("gate", "up", "down"):
            state[prefix + f"mlp.{name}_proj.weight"] = getattr(self, f"{name}_proj").weight
        return state


def _attend(q, keys: list, values: list) -> torch.Tensor:
    """Step 0 attends causally; step s > 0 also to one key of each earlier chain step (the diagonal)."""
    if len(keys) == 1:
        return F.scaled_dot_product_attention(q, keys[0], values[0], is_causal=True, enable_gqa=True)
    length = q.shape[2]
    eye = torch.eye(length, dtype=torch.bool)
    mask = torch.cat([torch.ones(length, length, dtype=torch.bool).tril()] + [eye] * (len(keys) - 1), dim=1)
    return F.scaled_dot_product_attention(q, torch.cat(keys, dim=2), torch.cat(values, dim=2),
                                          attn_mask=mask, enable_gqa=True)


class DraftVocabulary:
    """The d2t / t2d maps of a trainable head's draft vocabulary (a pruned one, or the target's)."""

    def register_vocabulary(self, d2t: torch.Tensor | None, vocab: int) -> None:
        """d2t [Vd] int64: the target ids of a pruned vocabulary (persistent: a resumed run keeps
        it), or None; t2d maps target ids back (-100: not in it)."""
        self.register_buffer("d2t", None if d2t is None else d2t.clone())
        t2d = torch.arange(vocab) if d2t is None else torch.full((vocab,), -100, dtype=torch.long)
        if d2t is not None:
            t2d[d2t] = torch.arange(len(d2t))
        self.register_buffer("t2d", t2d, persistent=False)

    def draft_labels(self, target_ids: torch.Tensor) -> torch.Tensor:
        """Target token ids -> draft vocabulary ids (-100 for tokens outside a pruned vocabulary)."""
        return self.t2d[target_ids]

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids if self.d2t is None else self.d2t[draft_ids]


class EagleTrainHead(nn.Module, DraftVocabulary):
    def __init__(self, config: dict, embed: torch.Tensor, lm_head: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, d2t: torch.Tensor | None):
        """embed [V, D] and lm_head [V, D] (the target's, frozen; compute dtype); cos/sin
        [max_positions, head_dim]; d2t [Vd] int64 target ids of a pruned draft vocabulary."""
        super().__init__()
        d = config["hidden_size"]
        self.fc = nn.Linear(2 * d, d, bias=config["bias"])
        self.layers = nn.ModuleList(DraftLayer(config, j) for j in range(config.get("num_hidden_layers", 1)))
        self.register_buffer("embed", embed, persistent=False)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.register_vocabulary(d2t, embed.shape[0])
        self.register_buffer("lm_head", lm_head if d2t is None else lm_head[d2t].contiguous(), persistent=False)

    def unroll(self, tokens: torch.Tensor, features: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """tokens [N, L] int64, features [N, L, D] -> per step s, predicted features [N, L, D]:
        row i is anchor i's f^_{i+s+1}. Padding past a sequence's end is harmless (causal)."""
        length = tokens.shape[1]
        inputs, outs = features.to(self.embed.dtype), []
        kv = [([], []) for _ in self.layers]  # per layer: every step's keys and values so far
        for s in range(steps):
            h = self.fc(torch.cat((F.embedding(shifted(tokens, s + 1), self.embed), inputs), dim=-1))
            cos, sin = self.cos[s : s + length], self.sin[s : s + length]
            for layer, (keys, values) in zip(self.layers, kv):
                h = layer(h, cos, sin, keys, values)
            outs.append(h)
            inputs = h
        return outs

    @staticmethod
    def readout(h: torch.Tensor) -> torch.Tensor:
        """What the lm_head reads of a predicted feature: itself (EAGLE-1 has no final norm)."""
        return h

    @staticmethod
    def inputs(batch) -> torch.Tensor:
        """What step 0 reads of a batch: the target's final-norm features."""
        return batch.features

    def _public_params(self) -> dict[str, nn.Parameter]:
        """The trained parameters by their names in the public EAGLE checkpoint."""
        state = {"fc.weight": self.fc.weight}
        if self.fc.bias is not None:
            state["fc.bias"] = self.fc.bias
        for j, layer in enumerate(self.layers):
            state |= layer.public_params(layer_prefix(j))
        return state

    def public_state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().float().clone() for k, v in self._public_params().items()}

    @torch.no_grad()
    def load_public_state(self, state: dict[str, torch.Tensor], *, grow: bool = False) -> None:
        """The weights of a public checkpoint (a shipped head), every trained tensor required.
        grow: the checkpoint may lack this head's last layers; those keep their init with o_proj
        and down_proj zeroed, so the head starts out computing what the checkpoint's does."""
        held = sum(1 for j in range(len(self.layers)) if any(k.startswith(layer_prefix(j)) for k in state))
        fresh = range(held if grow else len(self.layers), len(self.layers))
        for name, param in self._public_params().items():
            if any(name.startswith(layer_prefix(j)) for j in fresh):
                continue
            if name not in state or state[name].shape != param.shape:
                raise InvalidArgument(f"EAGLE checkpoint: {name} is missing or not of shape {list(param.shape)}")
            param.copy_(state[name].float())
        for j in fresh:
            self.layers[j].o_proj.weight.zero_()
            self.layers[j].down_proj.weight.zero_()


_LAYER_PARAMS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def upgrade_one_layer_checkpoint(saved: dict) -> None:
    """A training checkpoint (model and optimizer state) from before the head had a list of
    layers, in place: layer 0's parameters were named at the top level (q_proj.weight,
    post_norm), and post_norm, registered on the head itself, came first in the optimizer's
    order (which keys its state by position): post_norm, fc.weight, [fc.bias], q_proj ...
    down_proj. The layer list's order is fc.weight, [fc.bias], layers.0.post_norm, q_proj ..."""
    model = saved["model"]
    if "post_norm" not in model:
        return
    for name in [k for k in model if k == "post_norm" or k.split(".")[0] in _LAYER_PARAMS]:
        model[layer_prefix(0) + name] = model.pop(name)
    fc = 2 if "fc.bias" in model else 1
    old = list(range(1, 1 + fc)) + [0] + list(range(1 + fc, 1 + fc + len(_LAYER_PARAMS)))
    state = saved["optimizer"]["state"]
    saved["optimizer"]["state"] = {new: state[i] for new, i in enumerate(old) if i in state}


@torch.no_grad()
def init_from_target_layer(head: EagleTrainHead, layer: dict[str, torch.Tensor]) -> None:
    """Copies the target's last decoder layer (`layer`: its tensors by name within the layer,
    e.g. "self_attn.q_proj.weight") into the head's first; q/k/v absorb the input norm's weight,
    which EAGLE's layer 0 never applies. fc keeps its random init."""
    first, norm = head.layers[0], layer["input_layernorm.weight"].float()
    for name in "qkv":
        getattr(first, f"{name}_proj").weight.copy_(layer[f"self_attn.{name}_proj.weight"].float() * norm)
    first.o_proj.weight.copy_(layer["self_attn.o_proj.weight"].float())
    for name in ("gate", "up", "down"):
        getattr(first, f"{name}_proj").weight.copy_(layer[f"mlp.{name}_proj.weight"].float())
    first.post_norm.copy_(layer["post_attention_layernorm.weight"].float())
