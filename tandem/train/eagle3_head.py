"""Training EAGLE-3 heads (tandem.models.eagle3 serves them): the head reads the inputs of the
target's aux layers (by default 2, L/2 and L-3), ranks its own draft vocabulary with its own norm
and lm_head (initialised from the target's rows), and learns from the token loss alone: its
output is no longer asked to be the target's feature, only to predict the target's tokens,
through the training-time test's unrolled draft steps (EAGLE-3's recipe).

Step 0 feeds g_i = fc(aux_i) with t_{i+1} at position i; step s > 0 feeds the head's own output
of step s - 1, as drafting does; attention sees what a chain of depth s sees (eagle_head._attend).
"""

import torch
import torch.nn.functional as F
from torch import nn

from tandem.errors import InvalidArgument
from tandem.models.eagle3 import LAYER, eagle3_config_for_target
from tandem.models.eagle_io import read_eagle_checkpoint, save_eagle_checkpoint, vocab_ids_from_d2t
from tandem.train.eagle_head import DraftLayer, DraftVocabulary
from tandem.train.losses import shifted


class Eagle3TrainHead(nn.Module, DraftVocabulary):
    def __init__(self, config: dict, embed: torch.Tensor, lm_head: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 d2t: torch.Tensor | None):
        """config: the public EAGLE-3 config (its aux layers); embed [V, D] (the target's, frozen);
        lm_head [V, D] the target's, whose rows (d2t's, if pruned) start the head's own."""
        super().__init__()
        d, vocab = config["hidden_size"], embed.shape[0]
        self.fc = nn.Linear(len(config["eagle_aux_hidden_state_layer_ids"]) * d, d, bias=False)
        self.layer = DraftLayer(config, 0, in_width=2 * d)
        self.input_norm, self.hidden_norm, self.norm = (nn.Parameter(torch.ones(d)) for _ in range(3))
        self.lm_head = nn.Parameter((lm_head if d2t is None else lm_head[d2t]).float().clone())
        self.eps = config["rms_norm_eps"]
        self.register_buffer("embed", embed, persistent=False)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.register_vocabulary(d2t, vocab)

    def _norm(self, x: torch.Tensor, weight: nn.Parameter) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), weight.to(x.dtype), self.eps)

    def unroll(self, tokens: torch.Tensor, aux: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """tokens [N, L], aux [N, L, nD] -> per step s, the head's outputs h^ [N, L, D] (before
        its norm: what the next step reads); row i predicts t_{i+s+2} through `readout`."""
        length = tokens.shape[1]
        g, outs, keys, values = self.fc(aux.to(self.embed.dtype)), [], [], []
        for s in range(steps):
            embedded = self._norm(F.embedding(shifted(tokens, s + 1), self.embed), self.input_norm)
            x = torch.cat((embedded, self._norm(g, self.hidden_norm)), dim=-1)
            g = self.layer(g, self.cos[s : s + length], self.sin[s : s + length], keys, values, attn_input=x)
            outs.append(g)
        return outs

    def readout(self, h: torch.Tensor) -> torch.Tensor:
        """What the lm_head reads: the head's own final norm."""
        return self._norm(h, self.norm)

    @staticmethod
    def inputs(batch) -> torch.Tensor:
        """What step 0 reads of a batch: the aux layers' inputs."""
        return batch.aux

    def _public_params(self) -> dict[str, nn.Parameter]:
        state = {"fc.weight": self.fc.weight, "norm.weight": self.norm, "lm_head.weight": self.lm_head,
                 LAYER + "input_layernorm.weight": self.input_norm, LAYER + "hidden_norm.weight": self.hidden_norm}
        return state | self.layer.public_params(LAYER)

    def public_state_dict(self) -> dict[str, torch.Tensor]:
        state = {k: v.detach().float().clone() for k, v in self._public_params().items()}
        if self.d2t is not None:
            state["d2t"] = self.d2t - torch.arange(len(self.d2t))
            state["t2d"] = self.t2d >= 0
        return state

    @torch.no_grad()
    def load_public_state(self, state: dict[str, torch.Tensor]) -> None:
        for name, param in self._public_params().items():
            if name not in state or state[name].shape != param.shape:
                raise InvalidArgument(f"EAGLE-3 checkpoint: {name} is missing or not of shape {list(param.shape)}")
            param.copy_(state[name].float())


def read_eagle3_head(head_dir) -> tuple[dict, dict, torch.Tensor | None]:
    """(config, state, the draft vocabulary's target ids or None) of an EAGLE-3 head folder."""
    raw, state = read_eagle_checkpoint(head_dir)
    d2t = state.get("d2t")
    return raw, state, None if d2t is None else vocab_ids_from_d2t(d2t, raw["vocab_size"], str(head_dir))


def save_eagle3(out_dir, target_dir, head: Eagle3TrainHead, aux_layers: tuple[int, ...], fmt: str) -> None:
    draft_vocab = None if head.d2t is None else len(head.d2t)
    config = eagle3_config_for_target(target_dir, draft_vocab_size=draft_vocab, aux_layers=aux_layers)
    save_eagle_checkpoint(out_dir, config, head.public_state_dict(), format=fmt)
