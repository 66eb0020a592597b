"""Trains a tiny EAGLE-1 head on a tiny target's own greedy continuations, in seconds on a CPU,
so that tests and reduced benchmarks see real acceptance (a random head accepts almost nothing).

Data (self-distillation, as EAGLE's ge_data scripts do with the target's answers): random-token
prompts, the target's greedy continuations, and the target's final-norm feature at every
position. Training is teacher-forced as in EAGLE-1 (`eagle/train/main.py`): pair i = (f_i, t_{i+1})
-> predicted feature f^_{i+1}; loss = SmoothL1(f^_{i+1}, f_{i+1}) + CE_WEIGHT * cross-entropy of
lm_head(f^_{i+1}) against the target's own next token argmax lm_head(f_{i+1}) (= t_{i+2}).
The target's embedding and lm_head stay frozen; the checkpoint is written in the public format.

Warm start. A random-weight tiny target is chaotic: its greedy token depends on the whole
context (its own last 8 tokens agree with it 3% of the time; a bigram table gets 2.5%), and a
head trained from scratch memorises its training set and stays near chance (1%) on new prompts.
So the head starts as a copy of the target's last decoder layer, fed x = s * embed(t_{i+1})
(fc's feature half zero): for a 1-layer target that is the target itself up to EAGLE's one-token
lag (the head never sees t_0) and the per-token RMS of the input norm, which a linear fc cannot
reproduce; s and the input-norm scale are fitted on the data. On a 1-layer tiny target that
gives about 0.5 held-out top-1 (0.8 is the lag's ceiling); on the default 2-layer tiny target
the head stays near chance (about 0.02). The training steps then lower the loss but, with
seconds of data, do not raise held-out accuracy above the warm start's.
"""

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoModelForCausalLM

from tandem.models.eagle_io import head_config_for_target, layer_prefix, save_eagle_checkpoint
from tandem.models.rope import inverse_frequencies, rope_tables

PROMPT_LEN = 8
NEW_TOKENS = 48
TRAIN_SEQUENCES = 256
HELDOUT_SEQUENCES = 32
BATCH_SEQUENCES = 32
CE_WEIGHT = 0.1  # EAGLE-1's p_w (its v_w, on the feature loss, is 1)
LEARNING_RATE = 1e-4  # more undoes the warm start faster than this little data can teach
THREADS = 1  # tiny matmuls gain little from a 2nd thread, and lose 10-60x when the cores are shared


@dataclass(frozen=True, slots=True)
class SelfDistilled:
    tokens: torch.Tensor  # [N, L] int64: a random prompt, then the target's greedy continuation
    features: torch.Tensor  # [N, L, D] fp32: the target's final-norm hidden states
    labels: torch.Tensor  # [N, L - 1] int64: argmax lm_head(f_{i+1}), the target's token t_{i+2}
    prompt_len: int


@torch.no_grad()
def self_distill(
    target, *, num: int, seed: int, prompt_len: int = PROMPT_LEN, new_tokens: int = NEW_TOKENS
) -> SelfDistilled:
    """Greedy continuations of random prompts by a transformers causal LM, with its features."""
    vocab = target.config.vocab_size
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (num, prompt_len), generator=gen)  # 0-2 are special tokens
    for _ in range(new_tokens):  # tiny model: recomputing the whole prefix is cheaper than a cache
        ids = torch.cat([ids, target(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    features = target.model(ids).last_hidden_state.float()  # after the final norm
    labels = target.lm_head(features[:, 1:]).argmax(-1)
    return SelfDistilled(ids, features, labels, prompt_len)


class TrainableEagle(nn.Module):
    """EAGLE-1's forward over whole sequences (causal, no cache), in nn.Linear's [out, in] layout."""

    def __init__(self, config: dict, embed: torch.Tensor, lm_head: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        super().__init__()
        d, inter = config["hidden_size"], config["intermediate_size"]
        self.heads, self.kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
        self.head_dim = config["head_dim"]
        self.eps = config["rms_norm_eps"]
        self.fc = nn.Linear(2 * d, d, bias=config["bias"])
        self.q_proj = nn.Linear(d, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(d, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, d, bias=False)
        self.gate_proj = nn.Linear(d, inter, bias=False)
        self.up_proj = nn.Linear(d, inter, bias=False)
        self.down_proj = nn.Linear(inter, d, bias=False)
        self.post_norm = nn.Parameter(torch.ones(d))
        self.register_buffer("embed", embed, persistent=False)  # [V, D] frozen
        self.register_buffer("lm_head", lm_head, persistent=False)  # [V, D] frozen
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, tokens: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """tokens [N, L] (t_{i+1}), features [N, L, D] (f_i) -> predicted features [N, L, D]."""
        n, length = tokens.shape
        x = self.fc(torch.cat((F.embedding(tokens, self.embed), features), dim=-1))
        q = self._rope(self.q_proj(x).view(n, length, self.heads, self.head_dim).transpose(1, 2))
        k = self._rope(self.k_proj(x).view(n, length, self.kv_heads, self.head_dim).transpose(1, 2))
        v = self.v_proj(x).view(n, length, self.kv_heads, self.head_dim).transpose(1, 2)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        h = x + self.o_proj(attn.transpose(1, 2).reshape(n, length, -1))
        normed = F.rms_norm(h, (h.shape[-1],), self.post_norm, self.eps)
        return h + self.down_proj(F.silu(self.gate_proj(normed)) * self.up_proj(normed))

    def _rope(self, x: torch.Tensor) -> torch.Tensor:  # x [N, heads, L, d], rotate-half layout
        length, half = x.shape[2], x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * self.cos[:length] + rotated * self.sin[:length]

    def public_state_dict(self) -> dict[str, torch.Tensor]:
        p = layer_prefix(0)
        state = {"fc.weight": self.fc.weight, p + "post_attention_layernorm.weight": self.post_norm}
        if self.fc.bias is not None:
            state["fc.bias"] = self.fc.bias
        for name in "qkvo":
            state[p + f"self_attn.{name}_proj.weight"] = getattr(self, f"{name}_proj").weight
        for name in ("gate", "up", "down"):
            state[p + f"mlp.{name}_proj.weight"] = getattr(self, f"{name}_proj").weight
        return {k: v.detach().clone() for k, v in state.items()}


def continuation_accuracy(predicted_logits: torch.Tensor, data: SelfDistilled) -> float:
    """Top-1 accuracy of pair logits [N, L - 1, V] on the drafted positions: pairs i >= P - 1
    (P = prompt length) that have a next token, predicting t_{P+1} .. t_{L-1}."""
    first, last = data.prompt_len - 1, data.tokens.shape[1] - 2
    predicted = predicted_logits[:, first:last].argmax(-1)
    return (predicted == data.tokens[:, first + 2 :]).float().mean().item()


def train_tiny_eagle(target_dir: Path, out_dir: Path, *, steps: int = 300, seed: int = 0) -> Path:
    """Trains a head for the tiny target in `target_dir`; writes a public-format checkpoint and
    `training.json` (losses, held-out top-1 accuracy, seconds) into `out_dir`; returns `out_dir`."""
    started, threads = time.perf_counter(), torch.get_num_threads()
    torch.set_num_threads(THREADS)
    try:
        target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
        train = self_distill(target, num=TRAIN_SEQUENCES, seed=seed)
        heldout = self_distill(target, num=HELDOUT_SEQUENCES, seed=seed + 1)
        config = head_config_for_target(target_dir, fc_bias=True)
        inv_freq, scaling = inverse_frequencies(target_dir)  # the head config copies the target's rope
        cos, sin = rope_tables(inv_freq, scaling, train.tokens.shape[1])
        with torch.random.fork_rng(devices=[]):  # seeded, without touching the caller's RNG
            torch.manual_seed(seed)
            embed, lm_head = target.model.embed_tokens.weight.detach(), target.lm_head.weight.detach()
            head = TrainableEagle(config, embed, lm_head, cos, sin)
            warm_start(head, target, train)
            with torch.no_grad():
                start_loss, start_accuracy = _loss(head, train).item(), _accuracy(head, heldout)
            _train(head, train, steps)
        with torch.no_grad():
            end_loss, accuracy = _loss(head, train).item(), _accuracy(head, heldout)
    finally:
        torch.set_num_threads(threads)
    save_eagle_checkpoint(out_dir, config, head.public_state_dict(), format="bin")
    stats = {
        "steps": steps,
        "train_loss_start": start_loss,  # after the warm start, on the whole training set
        "train_loss_end": end_loss,
        "heldout_top1_warm_start": start_accuracy,
        "heldout_top1": accuracy,
        "seconds": time.perf_counter() - started,
    }
    (Path(out_dir) / "training.json").write_text(json.dumps(stats, indent=2) + "\n")
    return Path(out_dir)


@torch.no_grad()
def warm_start(head: TrainableEagle, target, data: SelfDistilled) -> None:
    """The target's last decoder layer, folded for the head (see the module docstring): fc feeds
    x = s * embed(t); q/k/v absorb the input norm's weight and mean 1/RMS and divide out s;
    o and down multiply by s, the least-squares scale from the layer's output to f."""
    layer = target.model.layers[-1]
    d = head.fc.weight.shape[0]
    inv_rms = F.embedding(data.tokens, head.embed).pow(2).mean(-1).rsqrt().mean()
    head.fc.weight.zero_()
    head.fc.weight[:, :d] = torch.eye(d)
    if head.fc.bias is not None:
        head.fc.bias.zero_()
    for name in "qkv":
        weight = getattr(layer.self_attn, f"{name}_proj").weight
        getattr(head, f"{name}_proj").weight.copy_(weight * layer.input_layernorm.weight * inv_rms)
    head.o_proj.weight.copy_(layer.self_attn.o_proj.weight)
    for name in ("gate", "up", "down"):
        getattr(head, f"{name}_proj").weight.copy_(getattr(layer.mlp, f"{name}_proj").weight)
    head.post_norm.copy_(layer.post_attention_layernorm.weight)
    predicted, wanted = _pair_logits(head, data)[0], data.features[:, 1:]
    s = float((predicted * wanted).sum() / (predicted * predicted).sum())
    head.fc.weight.mul_(s)  # every term of the residual scales by s; attention and the norm do not
    for name in "qkv":
        getattr(head, f"{name}_proj").weight.div_(s)
    head.o_proj.weight.mul_(s)
    head.down_proj.weight.mul_(s)


def _train(head: TrainableEagle, data: SelfDistilled, steps: int) -> None:
    """Adam (EAGLE's betas) on random batches of sequences, cosine decay."""
    optimizer = torch.optim.Adam(head.parameters(), lr=LEARNING_RATE, betas=(0.9, 0.95))
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, max(steps, 1))
    for _ in range(steps):
        rows = torch.randint(0, data.tokens.shape[0], (BATCH_SEQUENCES,))
        loss = _loss(head, SelfDistilled(data.tokens[rows], data.features[rows], data.labels[rows], data.prompt_len))
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        optimizer.step()
        schedule.step()


def _accuracy(head: TrainableEagle, data: SelfDistilled) -> float:
    return continuation_accuracy(_pair_logits(head, data)[1], data)


def _pair_logits(head: TrainableEagle, data: SelfDistilled) -> tuple[torch.Tensor, torch.Tensor]:
    """(predicted features, logits) of every pair i = (f_i, t_{i+1}), i = 0 .. L - 2."""
    predicted = head(data.tokens[:, 1:], data.features[:, :-1])
    return predicted, predicted @ head.lm_head.T


def _loss(head: TrainableEagle, data: SelfDistilled) -> torch.Tensor:
    predicted, logits = _pair_logits(head, data)
    feature_loss = F.smooth_l1_loss(predicted, data.features[:, 1:])
    token_loss = F.cross_entropy(logits.flatten(0, 1), data.labels.flatten())
    return feature_loss + CE_WEIGHT * token_loss
