"""The two draft methods the trainer knows, behind one small interface:

    build(cfg, data, saved_state) -> nn.Module   the trainable head(s), from the target's tensors
    loss(module, batch) -> (loss, metrics)        teacher-forced, on the target's answer tokens
    evaluate(module, batches) -> metrics          held-out top-1, greedy-chain and top-k tree accepted length
    save(module, out_dir)                         the public checkpoint format tandem loads

Their evaluation metrics (anchors, chains, trees, the walk) are tandem.train.acceptance's.
"""

import json
from pathlib import Path

import torch
import torch.nn.functional as F

from tandem.errors import InvalidArgument
from tandem.models.config import ModelConfig
from tandem.models.eagle import EagleConfig
from tandem.models.eagle3 import aux_layers_of, eagle3_config_for_target
from tandem.models.eagle_io import (head_config_for_target, read_draft_vocab, read_eagle_checkpoint, read_tensors,
                                    save_eagle_checkpoint, write_draft_vocab)
from tandem.models.medusa import PREFIX, read_medusa_checkpoint, save_medusa_checkpoint
from tandem.models.rope import inverse_frequencies, rope_tables
from tandem.train.acceptance import (STATIC_TREE_WIDTH, TREE_WIDTHS, anchor_rows, chain_metrics, draft_ranks, merge_parts,
                                     sampled_sums, static_tree_metrics)
from tandem.train.config import TrainConfig
from tandem.train.dataset import Batch, ShardedData
from tandem.train.eagle3_head import Eagle3TrainHead, read_eagle3_head, save_eagle3
from tandem.train.eagle_head import EagleTrainHead, init_from_target_layer
from tandem.train.losses import (IGNORE, chunked_topk, linear_cross_entropy, linear_soft_cross_entropy,
                                 sampled_acceptance, shifted, top1_hits)
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


def saved_layers(state: dict) -> int:
    """The decoder layers of an EAGLE head's training state dict (one when it predates the list)."""
    names = {k.split(".")[1] for k in state if k.startswith("layers.")}
    return max(len(names), 1)


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
        self.head_config = (eagle3_config_for_target(cfg.head_target_dir, aux_layers=cfg.aux_layers) if cfg.aux_layers
                            else head_config_for_target(cfg.head_target_dir, fc_bias=True))
        self._lm_head: torch.Tensor | None = None  # the target's whole lm_head, for the evaluation

    def build(self, data: ShardedData, saved: dict | None) -> EagleTrainHead:
        cfg = self.cfg
        embed, lm_head = target_embeddings(cfg.head_target_dir, self.dtype)
        d2t = saved.get("d2t") if saved else None
        if d2t is None:
            d2t = frequent_tokens(data, embed.shape[0], cfg.draft_vocab)
        layers = saved_layers(saved) if saved else cfg.draft_layers or 1
        if cfg.draft_layers and cfg.draft_layers != layers:
            raise InvalidArgument(f"the run holds a {layers}-layer head; resume it without --draft-layers {cfg.draft_layers}")
        return self._head(embed, lm_head, d2t, layers, init_from_target=cfg.init_from_target and not saved)

    def load(self, head_dir: Path) -> EagleTrainHead:
        """A head folder (a shipped head) as a training module, to evaluate it or to train it on
        (--init-head), with its own draft vocabulary; --draft-layers above the head's own adds
        layers that start out adding nothing (tandem.train.eagle_head: load_public_state)."""
        if self.cfg.aux_layers:
            return self._load_eagle3(head_dir)
        raw, state = read_eagle_checkpoint(head_dir)
        held = EagleConfig.from_dict(raw).num_layers
        layers = self.cfg.draft_layers or held
        if layers < held:
            raise InvalidArgument(f"--draft-layers {layers} is below the {held} layers of the head in {head_dir}")
        embed, lm_head = target_embeddings(self.cfg.head_target_dir, self.dtype)
        head = self._head(embed, lm_head, read_draft_vocab(head_dir, embed.shape[0]), layers, init_from_target=False)
        head.load_public_state(state, grow=layers > held)
        return head

    def _load_eagle3(self, head_dir: Path) -> Eagle3TrainHead:
        raw, state, d2t = read_eagle3_head(head_dir)
        layers = aux_layers_of(raw, ModelConfig.from_folder(self.cfg.head_target_dir).num_layers)
        if layers != self.cfg.aux_layers:
            raise InvalidArgument(f"the EAGLE-3 head in {head_dir} reads target layers {list(layers)}, "
                                  f"the run {list(self.cfg.aux_layers)}")
        if raw.get("norm_before_residual"):
            raise InvalidArgument(f"the EAGLE-3 head in {head_dir} adds its normed feature (norm_before_residual), "
                                  "which the trainer does not")
        embed, lm_head = target_embeddings(self.cfg.head_target_dir, self.dtype)
        head = self._head(embed, lm_head, d2t, 1, init_from_target=False)
        head.load_public_state(state)
        return head

    def _head(self, embed, lm_head, d2t, layers: int, *, init_from_target: bool) -> EagleTrainHead | Eagle3TrainHead:
        cfg = self.cfg
        if d2t is not None:
            self.head_config["draft_vocab_size"] = len(d2t)
        self.head_config["num_hidden_layers"] = layers
        inv_freq, scaling = inverse_frequencies(cfg.head_target_dir)
        longest = cfg.data.max_prompt_tokens + cfg.data.max_new_tokens + max(cfg.ttt_steps, cfg.eval_chain) + 1
        cos, sin = rope_tables(inv_freq, scaling, longest)
        torch.manual_seed(cfg.seed)
        if cfg.aux_layers:
            return Eagle3TrainHead(self.head_config, embed, lm_head, cos, sin, d2t)
        head = EagleTrainHead(self.head_config, embed, lm_head, cos, sin, d2t)
        if init_from_target:
            init_from_target_layer(head, target_last_layer(cfg.head_target_dir))
        return head

    def loss(self, head: EagleTrainHead, batch: Batch, with_hits: bool = True) -> tuple[torch.Tensor, dict]:
        """with_hits: also the depth-1 top-1 accuracy of the batch (metrics["top1"]; a pass of its own)."""
        total, metrics = 0.0, {}
        for s, predicted in enumerate(head.unroll(batch.tokens, head.inputs(batch), self.cfg.ttt_steps)):
            mask = batch.answer_mask(s + 2)  # pair i predicts f_{i+s+1} and t_{i+s+2}, an answer token
            wanted = shifted(batch.features, s + 1)[mask]  # f_{i+s+1}: its logits are the target's for t_{i+s+2}
            labels = head.draft_labels(shifted(batch.tokens, s + 2)[mask])
            ce, hits = self._token_loss(head, head.readout(predicted[mask]), wanted, labels, with_hits and s == 0)
            if self.cfg.aux_layers:  # EAGLE-3: the token loss alone, its features are its own
                feature_loss, step_loss = torch.zeros(()), ce
            else:
                feature_loss = F.smooth_l1_loss(predicted[mask].float(), wanted)
                step_loss = feature_loss + self.cfg.ce_weight * ce
            total = total + STEP_DECAY**s * step_loss
            if s == 0:
                metrics = {"feature_loss": float(feature_loss.detach()), "ce": float(ce.detach())}
                if with_hits:
                    metrics["top1"] = float(hits.sum()) / max(int(mask.sum()), 1)
        metrics["loss"] = float(total.detach())
        return total, metrics

    def _token_loss(self, head: EagleTrainHead, predicted, wanted, labels, with_hits: bool):
        """(token loss, top-1 hits): cross-entropy on the target's greedy token, or with
        --soft-labels the KL from its distribution over the draft vocabulary (every row counts,
        also those whose greedy token is outside a pruned vocabulary)."""
        if not self.cfg.soft_labels:
            ce, hits, _ = linear_cross_entropy(predicted, head.lm_head, labels, with_hits=with_hits)
            return ce, hits
        kl = linear_soft_cross_entropy(predicted, head.lm_head, wanted)
        return kl, top1_hits(predicted, head.lm_head, labels) if with_hits else None

    @torch.no_grad()
    def evaluate(self, head: EagleTrainHead, batches) -> dict:
        parts = []
        for batch in batches:
            anchors = batch.answer_mask(1) & batch.answer_mask(2)
            ranks, accepts = [], []
            for s, predicted in enumerate(head.unroll(batch.tokens, head.inputs(batch), self.cfg.eval_chain)):
                read = head.readout(predicted[anchors])
                top = head.to_target_ids(chunked_topk(read, head.lm_head, max(TREE_WIDTHS)))
                wanted = shifted(batch.tokens, s + 2, fill=IGNORE)[anchors]
                valid = batch.answer_mask(s + 2)[anchors]
                ranks.append(draft_ranks(top, wanted, valid))
                accept = sampled_acceptance(read, head.lm_head, shifted(batch.features, s + 1)[anchors],
                                            self._target_lm_head(head), head.d2t)
                accepts.append(accept * valid)
            parts.append(chain_metrics(ranks, anchor_rows(anchors)) | sampled_sums(accepts))
        return merge_parts(parts)

    def _target_lm_head(self, head: EagleTrainHead) -> torch.Tensor:
        """The target's whole lm_head: the head's own without a pruned vocabulary (EAGLE-1/2),
        else read once."""
        if head.d2t is None and not self.cfg.aux_layers:
            return head.lm_head
        if self._lm_head is None:
            self._lm_head = target_embeddings(self.cfg.head_target_dir, self.dtype)[1]
        return self._lm_head

    def save(self, head: EagleTrainHead | Eagle3TrainHead, out_dir) -> None:
        if self.cfg.aux_layers:  # d2t inside the checkpoint, as EAGLE-3 heads carry it
            save_eagle3(out_dir, self.cfg.head_target_dir, head, self.cfg.aux_layers, self.cfg.save_format)
            return
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

    def load(self, head_dir: Path) -> MedusaTrainHeads:
        """A head folder (a shipped head) as a training module, to evaluate it: its own number
        of heads, blocks and lm_heads, and its pruned vocabulary."""
        raw, state = read_medusa_checkpoint(head_dir)
        _, lm_head = target_embeddings(self.cfg.head_target_dir, self.dtype)
        self.vocab_ids = read_draft_vocab(head_dir, lm_head.shape[0])
        layers = raw.get("medusa_num_layers", 1)
        own = f"{PREFIX}0.{layers}.weight" in state
        heads = MedusaTrainHeads(raw["medusa_num_heads"], layers, lm_head, own)
        heads.load_public_state(state)
        return heads

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
        """Chain and full-tree metrics, and static trees built from the ranks (static_tree_metrics)."""
        parts, all_ranks, all_rows, seen = [], [], [], 0
        for batch in batches:
            anchors = batch.answer_mask(1) & batch.answer_mask(2)
            hidden = heads.hidden(batch.features[anchors].to(self.dtype))
            ranks = []
            for i in range(heads.num_heads):
                top = self._draft(hidden[i], heads.head_weight(i))
                wanted = shifted(batch.tokens, i + 2, fill=IGNORE)[anchors]
                ranks.append(draft_ranks(top, wanted, batch.answer_mask(i + 2)[anchors]))
            rows = anchor_rows(anchors)
            parts.append(chain_metrics(ranks, rows))
            all_ranks.append(torch.stack(ranks))
            all_rows.append(rows + seen)
            seen += len(anchors)
        trees = static_tree_metrics(torch.cat(all_ranks, 1), torch.cat(all_rows), STATIC_TREE_WIDTH)
        return merge_parts(parts) | {"static_trees": trees}

    def _draft(self, hidden: torch.Tensor, lm_head: torch.Tensor) -> torch.Tensor:
        """The best drafts of each row, [T, STATIC_TREE_WIDTH], within the pruned vocabulary when there is one."""
        k = max(STATIC_TREE_WIDTH, *TREE_WIDTHS)
        if self.vocab_ids is None:
            return chunked_topk(hidden, lm_head, k)
        return self.vocab_ids[chunked_topk(hidden, lm_head[self.vocab_ids], k)]

    def save(self, heads: MedusaTrainHeads, out_dir) -> None:
        state = heads.public_state_dict(dtype=self.dtype)  # own lm_heads in the compute dtype: half the size in bf16
        save_medusa_checkpoint(out_dir, heads.public_config(), state, format=self.cfg.save_format)
        write_draft_vocab(out_dir, self.vocab_ids, heads.head_weight(0).shape[0])


DRAFT_METHODS = {"eagle": EagleMethod, "medusa": MedusaMethod}
