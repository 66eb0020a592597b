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
from tandem.models.eagle_io import LAYER
from tandem.train.losses import shifted


class EagleTrainHead(nn.Module):
    def __init__(self, config: dict, embed: torch.Tensor, lm_head: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, d2t: torch.Tensor | None):
        """embed [V, D] and lm_head [V, D] (the target's, frozen; compute dtype); cos/sin
        [max_positions, head_dim]; d2t [Vd] int64 target ids of a pruned draft vocabulary."""
        super().__init__()
        d, inter = config["hidden_size"], config["intermediate_size"]
        self.heads, self.kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
        self.head_dim, self.eps = config["head_dim"], config["rms_norm_eps"]
        self.fc = nn.Linear(2 * d, d, bias=config["bias"])
        self.q_proj = nn.Linear(d, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(d, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, d, bias=False)
        self.gate_proj = nn.Linear(d, inter, bias=False)
        self.up_proj = nn.Linear(d, inter, bias=False)
        self.down_proj = nn.Linear(inter, d, bias=False)
        self.post_norm = nn.Parameter(torch.ones(d))
        self.register_buffer("embed", embed, persistent=False)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        vocab = embed.shape[0]
        if d2t is None:
            self.register_buffer("d2t", None)
            self.register_buffer("lm_head", lm_head, persistent=False)
            t2d = torch.arange(vocab)
        else:
            self.register_buffer("d2t", d2t.clone())  # persistent: a resumed run keeps its vocabulary
            self.register_buffer("lm_head", lm_head[d2t].contiguous(), persistent=False)
            t2d = torch.full((vocab,), -100, dtype=torch.long)
            t2d[d2t] = torch.arange(len(d2t))
        self.register_buffer("t2d", t2d, persistent=False)  # target id -> draft id (-100: not in it)

    def unroll(self, tokens: torch.Tensor, features: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """tokens [N, L] int64, features [N, L, D] -> per step s, predicted features [N, L, D]:
        row i is anchor i's f^_{i+s+1}. Padding past a sequence's end is harmless (causal)."""
        n, length = tokens.shape
        dtype = self.embed.dtype
        inputs, keys, values, outs = features.to(dtype), [], [], []
        for s in range(steps):
            x = self.fc(torch.cat((F.embedding(shifted(tokens, s + 1), self.embed), inputs), dim=-1))
            q, k, v = self._qkv(x, s)
            keys.append(k)
            values.append(v)
            h = x + self.o_proj(self._attend(q, keys, values).transpose(1, 2).reshape(n, length, -1))
            normed = F.rms_norm(h, (h.shape[-1],), self.post_norm.to(h.dtype), self.eps)
            out = h + self.down_proj(F.silu(self.gate_proj(normed)) * self.up_proj(normed))
            outs.append(out)
            inputs = out
        return outs

    def _qkv(self, x: torch.Tensor, offset: int):
        """q [N, H, L, d], k, v [N, KVH, L, d] of x [N, L, D] at positions offset .. offset + L - 1."""
        n, length, _ = x.shape
        cos, sin = self.cos[offset : offset + length], self.sin[offset : offset + length]

        def heads(t, count, rope):
            t = t.view(n, length, count, self.head_dim).transpose(1, 2)
            if not rope:
                return t
            half = self.head_dim // 2
            return t * cos.to(t.dtype) + torch.cat((-t[..., half:], t[..., :half]), dim=-1) * sin.to(t.dtype)

        return (heads(self.q_proj(x), self.heads, True), heads(self.k_proj(x), self.kv_heads, True),
                heads(self.v_proj(x), self.kv_heads, False))

    def _attend(self, q, keys: list, values: list) -> torch.Tensor:
        if len(keys) == 1:
            return F.scaled_dot_product_attention(q, keys[0], values[0], is_causal=True, enable_gqa=True)
        length = q.shape[2]
        eye = torch.eye(length, dtype=torch.bool)
        mask = torch.cat([torch.ones(length, length, dtype=torch.bool).tril()] + [eye] * (len(keys) - 1), dim=1)
        return F.scaled_dot_product_attention(q, torch.cat(keys, dim=2), torch.cat(values, dim=2),
                                              attn_mask=mask, enable_gqa=True)

    def draft_labels(self, target_ids: torch.Tensor) -> torch.Tensor:
        """Target token ids -> draft vocabulary ids (-100 for tokens outside a pruned vocabulary)."""
        return self.t2d[target_ids]

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids if self.d2t is None else self.d2t[draft_ids]

    def _public_params(self) -> dict[str, nn.Parameter]:
        """The trained parameters by their names in the public EAGLE checkpoint."""
        state = {"fc.weight": self.fc.weight, LAYER + "post_attention_layernorm.weight": self.post_norm}
        if self.fc.bias is not None:
            state["fc.bias"] = self.fc.bias
        for name in "qkvo":
            state[LAYER + f"self_attn.{name}_proj.weight"] = getattr(self, f"{name}_proj").weight
        for name in ("gate", "up", "down"):
            state[LAYER + f"mlp.{name}_proj.weight"] = getattr(self, f"{name}_proj").weight
        return state

    def public_state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().float().clone() for k, v in self._public_params().items()}

    @torch.no_grad()
    def load_public_state(self, state: dict[str, torch.Tensor]) -> None:
        """The weights of a public checkpoint (a shipped head), every trained tensor required."""
        for name, param in self._public_params().items():
            if name not in state or state[name].shape != param.shape:
                raise InvalidArgument(f"EAGLE checkpoint: {name} is missing or not of shape {list(param.shape)}")
            param.copy_(state[name].float())


@torch.no_grad()
def init_from_target_layer(head: EagleTrainHead, layer: dict[str, torch.Tensor]) -> None:
    """Copies the target's last decoder layer (`layer`: its tensors by name within the layer,
    e.g. "self_attn.q_proj.weight") into the head's; q/k/v absorb the input norm's weight,
    which EAGLE's layer 0 never applies. fc keeps its random init."""
    norm = layer["input_layernorm.weight"].float()
    for name in "qkv":
        getattr(head, f"{name}_proj").weight.copy_(layer[f"self_attn.{name}_proj.weight"].float() * norm)
    head.o_proj.weight.copy_(layer["self_attn.o_proj.weight"].float())
    for name in ("gate", "up", "down"):
        getattr(head, f"{name}_proj").weight.copy_(layer[f"mlp.{name}_proj.weight"].float())
    head.post_norm.copy_(layer["post_attention_layernorm.weight"].float())
