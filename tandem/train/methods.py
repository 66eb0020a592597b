"""The two draft methods the trainer knows, behind one small interface:

    build(cfg, data, saved_state) -> nn.Module   the trainable head(s), from the target's tensors
    loss(module, batch) -> (loss, metrics)        teacher-forced, on the target's answer tokens
    evaluate(module, batches) -> metrics          held-out top-1 and greedy-chain accepted length
    save(module, out_dir)                         the public checkpoint format tandem loads

Words: anchor (n, i) = a position whose next token t_{i+1} is an answer token the target has
emitted (the pending token at serve time); a greedy chain from it drafts t_{i+2}, t_{i+3}, ...;
its accepted length is 1 (the target's own token) + the drafts equal to the target's tokens
before the first that is not.
"""

import json
from pathlib import Path

import torch
import torch.nn.functional as F

from tandem.models.eagle_io import D2T_FILE, head_config_for_target, read_tensors, save_eagle_checkpoint, write_draft_vocab
from tandem.models.medusa import save_medusa_checkpoint
from tandem.models.rope import inverse_frequencies, rope_tables
from tandem.train.config import TrainConfig
from tandem.train.dataset import Batch, ShardedData
from tandem.train.eagle_head import EagleTrainHead, init_from_target_layer
from tandem.train.losses import IGNORE, accepted_lengths, chunked_argmax, linear_cross_entropy, shifted
from tandem.train.medusa_heads import MedusaTrainHeads

STEP_DECAY = 0.8  # weight of draft step / head i: 0.8 ** i (Medusa-1's decay, EAGLE-3's TTT weights)


def target_embeddings(target_dir, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(embed [V, D], lm_head [V, D]) of the target, tied or not, in `dtype`."""
    found = read_tensors(target_dir, {"model.embed_tokens.weight", "lm_head.weight"})
    embed = found["model.embed_tokens.weight"].to(dtype).contiguous()
    return embed, found["lm_head.weight"].to(dtype).contiguous() if "lm_head.weight" in found else embed


def target_last_layer(target_dir: Path) -> dict[str, torch.Tensor]:
    """The tensors of the target's last decoder layer, by name within the layer."""
    layers = json.loads((Path(target_dir) / "config.json").read_text())["num_hidden_layers"]
    prefix = f"model.layers.{layers - 1}."
    names = [f"self_attn.{n}_proj.weight" for n in "qkvo"] + [f"mlp.{n}_proj.weight" for n in ("gate", "up", "down")]
    names += ["input_layernorm.weight", "post_attention_layernorm.weight"]
    found = read_tensors(target_dir, {prefix + n for n in names})
    return {n: found[prefix + n] for n in names}


def _chain_metrics(matches: list[torch.Tensor]) -> dict:
    """matches: per draft depth, [A] bool over the same anchors."""
    stacked = torch.stack(matches)
    lengths = accepted_lengths(stacked, torch.ones(stacked.shape[1], dtype=torch.bool))
    reached = torch.cumprod(stacked.long(), dim=0).float().mean(1)
    return {"anchors": int(stacked.shape[1]), "heldout_top1": float(stacked[0].float().mean()),
            "mean_accepted_length": float(lengths.float().mean()), "chain_length": len(matches),
            "accepted_rate_by_depth": [round(float(r), 4) for r in reached]}


def _merge(parts: list[dict]) -> dict:
    """Anchor-weighted mean of per-batch chain metrics."""
    total = sum(p["anchors"] for p in parts)
    out = {"anchors": total, "chain_length": parts[0]["chain_length"]}
    for key in ("heldout_top1", "mean_accepted_length"):
        out[key] = sum(p[key] * p["anchors"] for p in parts) / max(total, 1)
    depth = len(parts[0]["accepted_rate_by_depth"])
    out["accepted_rate_by_depth"] = [
        round(sum(p["accepted_rate_by_depth"][d] * p["anchors"] for p in parts) / max(total, 1), 4) for d in range(depth)]
    return out


def frequent_tokens(data: ShardedData, vocab_size: int, n: int) -> torch.Tensor | None:
    """The target ids of the n most frequent answer tokens, ascending: a pruned draft vocabulary
    (None when n is 0 or covers the vocabulary)."""
    if not n or n >= vocab_size:
        return None
    return torch.sort(torch.topk(data.answer_token_counts(vocab_size), n).indices).values


class EagleMethod:
    name = "eagle"

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        self.dtype = getattr(torch, cfg.compute_dtype)
        self.head_config = head_config_for_target(cfg.head_target_dir, fc_bias=True)

    def build(self, data: ShardedData, saved: dict | None) -> EagleTrainHead:
        cfg = self.cfg
        embed, lm_head = target_embeddings(cfg.head_target_dir, self.dtype)
        d2t = saved.get("d2t") if saved else None
        if d2t is None:
            d2t = frequent_tokens(data, embed.shape[0], cfg.draft_vocab)
        if d2t is not None:
            self.head_config["draft_vocab_size"] = len(d2t)
        inv_freq, scaling = inverse_frequencies(cfg.head_target_dir)
        longest = cfg.data.max_prompt_tokens + cfg.data.max_new_tokens + max(cfg.ttt_steps, cfg.eval_chain) + 1
        cos, sin = rope_tables(inv_freq, scaling, longest)
        torch.manual_seed(cfg.seed)
        head = EagleTrainHead(self.head_config, embed, lm_head, cos, sin, d2t)
        if cfg.init_from_target and not saved:
            init_from_target_layer(head, target_last_layer(cfg.head_target_dir))
        return head

    def loss(self, head: EagleTrainHead, batch: Batch, with_hits: bool = True) -> tuple[torch.Tensor, dict]:
        """with_hits: also the depth-1 top-1 accuracy of the batch (metrics["top1"]; a pass of its own)."""
        total, metrics = 0.0, {}
        for s, predicted in enumerate(head.unroll(batch.tokens, batch.features, self.cfg.ttt_steps)):
            mask = batch.answer_mask(s + 2)  # pair i predicts f_{i+s+1} and t_{i+s+2}, an answer token
            feature_loss = F.smooth_l1_loss(predicted[mask].float(), shifted(batch.features, s + 1)[mask])
            labels = head.draft_labels(shifted(batch.tokens, s + 2)[mask])
            ce, hits, _ = linear_cross_entropy(predicted[mask], head.lm_head, labels, with_hits=with_hits and s == 0)
            total = total + STEP_DECAY**s * (feature_loss + self.cfg.ce_weight * ce)
            if s == 0:
                metrics = {"feature_loss": float(feature_loss.detach()), "ce": float(ce.detach())}
                if with_hits:
                    metrics["top1"] = float(hits.sum()) / max(int(mask.sum()), 1)
        metrics["loss"] = float(total.detach())
        return total, metrics

    @torch.no_grad()
    def evaluate(self, head: EagleTrainHead, batches) -> dict:
        parts = []
        for batch in batches:
            anchors = batch.answer_mask(1) & batch.answer_mask(2)
            matches = []
            for s, predicted in enumerate(head.unroll(batch.tokens, batch.features, self.cfg.eval_chain)):
                drafted = head.to_target_ids(chunked_argmax(predicted[anchors], head.lm_head))
                wanted = shifted(batch.tokens, s + 2, fill=IGNORE)[anchors]
                matches.append((drafted == wanted) & batch.answer_mask(s + 2)[anchors])
            parts.append(_chain_metrics(matches))
        return _merge(parts)

    def save(self, head: EagleTrainHead, out_dir) -> None:
        save_eagle_checkpoint(out_dir, self.head_config, head.public_state_dict(), format=self.cfg.save_format)
        write_draft_vocab(out_dir, head.d2t, head.embed.shape[0])


class MedusaMethod:
    name = "medusa"

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        self.dtype = getattr(torch, cfg.compute_dtype)
        # --draft-vocab: the tokens the served heads rank (training's loss keeps the whole
        # vocabulary; evaluation drafts from these only, as the draft service will).
        self.vocab_ids: torch.Tensor | None = None

    def build(self, data: ShardedData, saved: dict | None) -> MedusaTrainHeads:
        cfg = self.cfg
        _, lm_head = target_embeddings(cfg.head_target_dir, self.dtype)
        self.vocab_ids = frequent_tokens(data, lm_head.shape[0], cfg.draft_vocab)
        torch.manual_seed(cfg.seed)
        return MedusaTrainHeads(cfg.medusa_heads, cfg.medusa_layers, lm_head, cfg.medusa_lm_head == "own")

    def _rows(self, batch: Batch) -> torch.Tensor:
        """[N, L] bool: positions some head has a label for."""
        rows = batch.answer_mask(2)
        for i in range(1, self.cfg.medusa_heads):
            rows |= batch.answer_mask(i + 2)
        return rows

    def loss(self, heads: MedusaTrainHeads, batch: Batch, with_hits: bool = True) -> tuple[torch.Tensor, dict]:
        rows = self._rows(batch)
        hidden = heads.hidden(batch.features[rows].to(self.dtype))
        total, metrics = 0.0, {}
        for i in range(heads.num_heads):
            labels = shifted(batch.tokens, i + 2)[rows].masked_fill(~batch.answer_mask(i + 2)[rows], IGNORE)
            ce, hits, count = linear_cross_entropy(hidden[i], heads.head_weight(i), labels,
                                                   with_hits=with_hits and i == 0)
            total = total + STEP_DECAY**i * ce
            metrics[f"ce{i}"] = float(ce.detach())
            if i == 0 and with_hits:
                metrics["top1"] = float(hits.sum()) / max(count, 1)
        metrics["loss"] = float(total.detach())
        return total, metrics

    @torch.no_grad()
    def evaluate(self, heads: MedusaTrainHeads, batches) -> dict:
        parts = []
        for batch in batches:
            anchors = batch.answer_mask(1) & batch.answer_mask(2)
            hidden = heads.hidden(batch.features[anchors].to(self.dtype))
            matches = []
            for i in range(heads.num_heads):
                drafted = self._draft(hidden[i], heads.head_weight(i))
                wanted = shifted(batch.tokens, i + 2, fill=IGNORE)[anchors]
                matches.append((drafted == wanted) & batch.answer_mask(i + 2)[anchors])
            parts.append(_chain_metrics(matches))
        return _merge(parts)

    def _draft(self, hidden: torch.Tensor, lm_head: torch.Tensor) -> torch.Tensor:
        """The greedy draft of each row, within the pruned vocabulary when there is one."""
        if self.vocab_ids is None:
            return chunked_argmax(hidden, lm_head)
        return self.vocab_ids[chunked_argmax(hidden, lm_head[self.vocab_ids])]

    def save(self, heads: MedusaTrainHeads, out_dir) -> None:
        state = heads.public_state_dict(dtype=self.dtype)  # own lm_heads in the compute dtype: half the size in bf16
        save_medusa_checkpoint(out_dir, heads.public_config(), state, format=self.cfg.save_format)
        write_draft_vocab(out_dir, self.vocab_ids, heads.head_weight(0).shape[0])


DRAFT_METHODS = {"eagle": EagleMethod, "medusa": MedusaMethod}
