"""Trainable Medusa-1 heads (FasterDecoding/Medusa `medusa_model.py`): head i is
`medusa_num_layers` residual blocks x + SiLU(W x + b) on the target's feature f_t, then an
lm_head, and predicts t_{t+i+2}. As in Medusa-1, W starts at zero (each head starts as the
identity), b keeps nn.Linear's default init, and an own lm_head starts as a copy of the
target's; a shared lm_head is the target's, frozen (the checkpoint then holds no lm_head and
is small).
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

from tandem.errors import InvalidArgument
from tandem.models.medusa import PREFIX


class MedusaTrainHeads(nn.Module):
    def __init__(self, num_heads: int, num_layers: int, lm_head: torch.Tensor, own_lm_head: bool):
        """lm_head [V, D]: the target's (frozen copy in the compute dtype, or the own heads' start)."""
        super().__init__()
        vocab, d = lm_head.shape
        self.num_heads, self.num_layers = num_heads, num_layers
        self.weight = nn.Parameter(torch.zeros(num_heads, num_layers, d, d))  # [out, in] per block
        bound = 1 / math.sqrt(d)
        self.bias = nn.Parameter(torch.empty(num_heads, num_layers, d).uniform_(-bound, bound))
        if own_lm_head:
            self.lm_heads = nn.Parameter(lm_head.float()[None].repeat(num_heads, 1, 1))  # [H, V, D]
            self.register_buffer("shared_lm_head", None)
        else:
            self.register_parameter("lm_heads", None)
            self.register_buffer("shared_lm_head", lm_head, persistent=False)

    def hidden(self, features: torch.Tensor) -> torch.Tensor:
        """features [T, D] -> each head's last hidden state, [H, T, D]."""
        x = features[None].expand(self.num_heads, -1, -1)
        for j in range(self.num_layers):
            x = x + F.silu(torch.baddbmm(self.bias[:, j, None, :], x, self.weight[:, j].transpose(1, 2)))
        return x

    def head_weight(self, i: int) -> torch.Tensor:
        """[V, D]: head i's lm_head."""
        return self.lm_heads[i] if self.lm_heads is not None else self.shared_lm_head

    def public_config(self) -> dict:
        vocab, d = self.head_weight(0).shape
        return {"architectures": ["MedusaModel"], "medusa_num_heads": self.num_heads,
                "medusa_num_layers": self.num_layers, "hidden_size": d, "vocab_size": vocab}

    def _public_tensors(self) -> dict[str, torch.Tensor]:
        """Views of the trained tensors by their names in the public Medusa checkpoint."""
        state = {}
        for i in range(self.num_heads):
            for j in range(self.num_layers):
                state[f"{PREFIX}{i}.{j}.linear.weight"] = self.weight[i, j]
                state[f"{PREFIX}{i}.{j}.linear.bias"] = self.bias[i, j]
            if self.lm_heads is not None:
                state[f"{PREFIX}{i}.{self.num_layers}.weight"] = self.lm_heads[i]
        return state

    @torch.no_grad()
    def load_public_state(self, state: dict[str, torch.Tensor]) -> None:
        """The weights of a public checkpoint (a shipped head) with this module's shape."""
        mine = self._public_tensors()
        if set(state) != set(mine) or any(state[k].shape != t.shape for k, t in mine.items()):
            raise InvalidArgument(f"Medusa checkpoint tensors do not fit {self.num_heads} heads of {self.num_layers} "
                                  f"block(s) (names differing: {sorted(set(state) ^ set(mine))[:4]})")
        for name, t in mine.items():
            t.copy_(state[name].float())

    def public_state_dict(self, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
        """lm_heads in `dtype`, the blocks in fp32."""
        lm = f".{self.num_layers}.weight"
        return {k: v.detach().to(dtype if k.endswith(lm) else torch.float32).clone() for k, v in self._public_tensors().items()}
