"""The two draft methods the trainer knows, behind one small interface:

    build(cfg, data, saved_state) -> nn.Module   the trainable head(s), from the target's tensors
    loss(module, batch) -> (loss, metrics)        teacher-forced, on the target's answer tokens
    evaluate(module, batches) -> metrics          held-out top-1, greedy-chain and top-k tree accepted length
    save(module, out_dir)                         the public checkpoint format tandem loads

Words: anchor (n, i) = a position whose next token t_{i+1} is an answer token the target has
emitted (the pending token at serve time); a greedy chain from it drafts t_{i+2}, t_{i+3}, ...;
its accepted length is 1 (the target's own token) + the drafts equal to the target's tokens
before the first that is not. A full top-k tree of the same depth (every node's k best children)
accepts down to the first depth whose target token is not among the draft's k best there.

Two means of the accepted length: over every anchor ("mean_accepted_length"), and over the
anchors a served greedy decode verifies from ("walk_*": each verify step starts where the last
one's tokens end). Serving reports the second. Where acceptance runs in streaks the two differ:
an accepted draft skips the anchors after it, which are the easy ones, so steps land on hard
anchors more often than their share.
"""

import json
from pathlib import Path

import torch
import torch.nn.functional as F

from tandem.errors import InvalidArgument
from tandem.models.eagle import EagleConfig
from tandem.models.eagle_io import (D2T_FILE, head_config_for_target, read_draft_vocab, read_eagle_checkpoint, read_tensors,
                                    save_eagle_checkpoint, write_draft_vocab)
from tandem.models.medusa import PREFIX, read_medusa_checkpoint, save_medusa_checkpoint
from tandem.models.rope import inverse_frequencies, rope_tables
from tandem.spec.token_tree import SMALL_STATIC_TREE
from tandem.train.config import TrainConfig
from tandem.train.dataset import Batch, ShardedData
from tandem.train.eagle_head import EagleTrainHead, init_from_target_layer
from tandem.train.losses import (IGNORE, accepted_lengths, chunked_topk, linear_cross_entropy, linear_soft_cross_entropy,
                                 sampled_acceptance, shifted, top1_hits)
from tandem.train.medusa_heads import MedusaTrainHeads

STEP_DECAY = 0.8  # weight of draft step / head i: 0.8 ** i (Medusa-1's decay, EAGLE-3's TTT weights)
TREE_WIDTHS = (2, 3)  # the full top-k trees evaluated next to the greedy chains
STATIC_TREE_WIDTH = 16  # Medusa: ranks a static tree built from the evaluation may use per head
STATIC_TREE_SIZES = (10, 30, 60)  # its node counts: the served default's size, and GPU sizes


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


def draft_ranks(top: torch.Tensor, wanted: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """top [A, K] the draft's best ids, wanted [A] the target's tokens, valid [A] where wanted is an
    answer token -> [A] the rank of wanted among top (K: absent, or not an answer token)."""
    hit = (top == wanted[:, None]) & valid[:, None]
    return torch.where(hit.any(1), hit.long().argmax(1), top.shape[1])


def anchor_rows(anchors: torch.Tensor) -> torch.Tensor:
    """anchors [N, L] bool -> [A] the sequence of each anchor, in the order anchors[mask] takes them."""
    return anchors.nonzero()[:, 0]


def _chain_metrics(ranks: list[torch.Tensor], rows: torch.Tensor) -> dict:
    """ranks: per draft depth, [A] the target token's rank among the draft's best, same anchors;
    rows [A]: each anchor's sequence, anchors of a sequence consecutive and in answer order."""
    stacked = torch.stack(ranks)
    every = torch.ones(stacked.shape[1], dtype=torch.bool)
    chain = stacked == 0
    reached = torch.cumprod(chain.long(), dim=0).float().mean(1)
    lengths = {"chain": accepted_lengths(chain, every)} | {f"top{k}": accepted_lengths(stacked < k, every)
                                                           for k in TREE_WIDTHS}
    walks = {name: walk_histogram(a, rows, len(ranks) + 1) for name, a in lengths.items()}
    return {"anchors": int(stacked.shape[1]), "heldout_top1": float(chain[0].float().mean()),
            "mean_accepted_length": float(lengths["chain"].float().mean()), "chain_length": len(ranks),
            "accepted_rate_by_depth": [round(float(r), 4) for r in reached],
            "tree_accepted_length": {f"top{k}": float(lengths[f"top{k}"].float().mean()) for k in TREE_WIDTHS},
            "tree_nodes": {f"top{k}": sum(k**d for d in range(1, len(ranks) + 1)) for k in TREE_WIDTHS},
            **_walk_metrics(walks)}


def _sampled_sums(accepts: list[torch.Tensor]) -> dict:
    """accepts: per draft depth, [A] the chance temperature-1 sampling accepts that depth's draft
    from each anchor (0 past the answer's end) -> sums that merge across batches: per depth, the
    chance a chain is accepted that far (a_1 a_2 ... a_d, as the greedy accepted_rate_by_depth),
    and each anchor's expected tokens a verify yields, 1 + a_1 + a_1 a_2 + ... (every later draft
    scored on the target's greedy continuation: an estimate, teacher-forced)."""
    reached = torch.cumprod(torch.stack(accepts), 0)  # the chance a chain from the anchor gets past depth d
    return {"sampled_sums": {"by_depth": reached.sum(1).tolist(), "accepted_length": float((1 + reached.sum(0)).sum())}}


def walk_histogram(lengths: torch.Tensor, rows: torch.Tensor, longest: int) -> list[int]:
    """The verify steps of served greedy decoding over these anchors: in each sequence the first
    step starts at its first anchor and each next one `length` anchors further (its drafts and
    the target's token). Returns [c_0, ..., c_longest]: c_a steps accepted a tokens."""
    counts = [0] * (longest + 1)
    lengths, rows = lengths.tolist(), rows.tolist()
    i = 0
    while i < len(lengths):
        counts[lengths[i]] += 1
        step = i + lengths[i]
        i = step if step < len(lengths) and rows[step] == rows[i] else _next_row(rows, i)
    return counts


def _next_row(rows: list[int], i: int) -> int:
    row = rows[i]
    while i < len(rows) and rows[i] == row:
        i += 1
    return i


def _walk_metrics(walks: dict[str, list[int]]) -> dict:
    """walk_accepted_length (chains), walk_rate_by_depth (the steps' share reaching depth d),
    walk_tree_accepted_length, walk_steps, and the histograms (summed when batches merge)."""
    def mean(counts: list[int]) -> float:
        return sum(a * c for a, c in enumerate(counts)) / max(sum(counts), 1)

    chain = walks["chain"]
    steps = max(sum(chain), 1)
    return {"walk_accepted_length": mean(chain), "walk_steps": sum(chain),
            "walk_rate_by_depth": [round(sum(chain[d + 1:]) / steps, 4) for d in range(1, len(chain) - 1)],
            "walk_tree_accepted_length": {k: mean(c) for k, c in walks.items() if k != "chain"},
            "walk_histograms": walks}


def static_tree_lengths(ranks: torch.Tensor, choices, width: int) -> torch.Tensor:
    """ranks [H, A]: per head the rank of the target's token among its best `width` (width:
    absent); choices: a prefix-closed set of rank paths (Medusa's static tree) -> [A] the tokens
    one verify step of that tree yields from each anchor: 1 + the deepest choice its ranks follow."""
    chosen, out = set(map(tuple, choices)), []
    for col in ranks.T.tolist():
        depth = 0
        while depth < len(col) and col[depth] < width and tuple(col[: depth + 1]) in chosen:
            depth += 1
        out.append(1 + depth)
    return torch.tensor(out, dtype=torch.long)


def best_static_tree(ranks: torch.Tensor, size: int, width: int) -> tuple[tuple[int, ...], ...]:
    """The `size` rank paths the most anchors follow, as a static tree (Medusa builds its trees
    from such statistics), best first. A path is followed at most as often as its parent, so
    taking paths by count (ties: shallower, then lower ranks) with their parent already in
    maximises the mean accepted length over these anchors for that size, and so does every
    prefix of the result for its own size (the served tree under a node budget)."""
    counts: dict[tuple[int, ...], int] = {}
    for col in ranks.T.tolist():
        for depth in range(len(col)):
            if col[depth] >= width:
                break
            path = tuple(col[: depth + 1])
            counts[path] = counts.get(path, 0) + 1
    chosen: dict[tuple[int, ...], None] = {}  # ordered
    for path in sorted(counts, key=lambda c: (-counts[c], len(c), c)):
        if len(chosen) == size:
            break
        if len(path) == 1 or path[:-1] in chosen:
            chosen[path] = None
    return tuple(chosen)


def static_tree_metrics(ranks: torch.Tensor, rows: torch.Tensor, width: int, sizes=STATIC_TREE_SIZES) -> dict:
    """Static trees fit on the first half of the sequences and measured on the other half (so the
    figures are not the fit's own data): {size: choices, mean and walked accepted length}."""
    sequences = rows.unique()
    cut = sequences[len(sequences) // 2]
    fit, held = rows < cut, rows >= cut

    def measured(choices) -> dict:
        lengths = static_tree_lengths(ranks[:, held], choices, width)
        walk = walk_histogram(lengths, rows[held], ranks.shape[0] + 1)
        return {"choices": [list(c) for c in choices], "mean_accepted_length": float(lengths.float().mean()),
                "walk_accepted_length": sum(a * c for a, c in enumerate(walk)) / max(sum(walk), 1)}

    out = {str(size): measured(best_static_tree(ranks[:, fit], size, width)) for size in sizes}
    # the served default when a head folder names no tree, on the same half
    out["default"] = measured(tuple(c for c in SMALL_STATIC_TREE if len(c) <= ranks.shape[0]))
    return out


def fitted_tree(metrics: dict) -> tuple | None:
    """The largest static tree static_tree_metrics fit (best first); None without one."""
    trees = {int(k): v for k, v in metrics.get("static_trees", {}).items() if k != "default"}
    return tuple(map(tuple, trees[max(trees)]["choices"])) if trees else None


def describe_chain(metrics: dict) -> str:
    """One line: depth-1 top-1, accepted lengths per verify as served (the walk) and over every
    anchor, for chains and full trees."""
    trees = metrics.get("walk_tree_accepted_length", {})
    walked = " / ".join(f"{v:.3f}" for v in [metrics["walk_accepted_length"], *trees.values()])
    return (f"top-1 {metrics['heldout_top1']:.3f}; accepted length per verify step, served greedy walk, chains of "
            f"{metrics['chain_length']} / full {' / '.join(k.replace('top', 'top-') for k in trees)} trees: {walked} "
            f"(depth 1..k {metrics['walk_rate_by_depth']}); mean over every anchor: "
            f"{metrics['mean_accepted_length']:.3f}, {describe_trees(metrics)}{_describe_static(metrics)}"
            f"{_describe_sampled(metrics)}")


def _describe_sampled(metrics: dict) -> str:
    if "t1_accepted_length" not in metrics:
        return ""
    return (f"; temperature 1, chains of {metrics['chain_length']} (teacher-forced estimate over every anchor): "
            f"{metrics['t1_accepted_length']:.3f} (depth 1..k {metrics['t1_accept_by_depth']})")


def _describe_static(metrics: dict) -> str:
    trees = metrics.get("static_trees")
    if not trees:
        return ""
    sizes = [k for k in trees if k != "default"]
    walked = " / ".join(f"{trees[k]['walk_accepted_length']:.3f}" for k in sizes)
    return (f"; static trees of {' / '.join(sizes)} nodes (fit on half the sequences, measured on the other), walked: "
            f"{walked} (the {len(trees['default']['choices'])}-node default: {trees['default']['walk_accepted_length']:.3f})")


def describe_trees(metrics: dict) -> str:
    """'full top-2 / top-3 trees (30 / 120 nodes) 2.105 / 2.312', or '' for metrics without trees."""
    trees = metrics.get("tree_accepted_length")
    if not trees:
        return ""
    widths = " / ".join(k.replace("top", "top-") for k in trees)
    nodes = " / ".join(str(metrics["tree_nodes"][k]) for k in trees)
    return f"full {widths} trees ({nodes} nodes) {' / '.join(f'{v:.3f}' for v in trees.values())}"


def _merge(parts: list[dict]) -> dict:
    """Anchor-weighted mean of per-batch chain metrics."""
    total = sum(p["anchors"] for p in parts)

    def mean(value) -> float:
        return sum(value(p) * p["anchors"] for p in parts) / max(total, 1)

    first = parts[0]
    out = {"anchors": total, "chain_length": first["chain_length"], "tree_nodes": first["tree_nodes"]}
    for key in ("heldout_top1", "mean_accepted_length"):
        out[key] = mean(lambda p: p[key])
    out["accepted_rate_by_depth"] = [round(mean(lambda p: p["accepted_rate_by_depth"][d]), 4)
                                     for d in range(len(first["accepted_rate_by_depth"]))]
    out["tree_accepted_length"] = {k: mean(lambda p: p["tree_accepted_length"][k]) for k in first["tree_accepted_length"]}
    walks = {k: [sum(c) for c in zip(*(p["walk_histograms"][k] for p in parts))] for k in first["walk_histograms"]}
    if "sampled_sums" in first:  # EAGLE: temperature-1 acceptance, means over every anchor
        by_depth = [sum(c) for c in zip(*(p["sampled_sums"]["by_depth"] for p in parts))]
        out["t1_accept_by_depth"] = [round(v / max(total, 1), 4) for v in by_depth]
        out["t1_accepted_length"] = sum(p["sampled_sums"]["accepted_length"] for p in parts) / max(total, 1)
    return out | _walk_metrics(walks)


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
        self.head_config = head_config_for_target(cfg.head_target_dir, fc_bias=True)
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
        raw, state = read_eagle_checkpoint(head_dir)
        held = EagleConfig.from_dict(raw).num_layers
        layers = self.cfg.draft_layers or held
        if layers < held:
            raise InvalidArgument(f"--draft-layers {layers} is below the {held} layers of the head in {head_dir}")
        embed, lm_head = target_embeddings(self.cfg.head_target_dir, self.dtype)
        head = self._head(embed, lm_head, read_draft_vocab(head_dir, embed.shape[0]), layers, init_from_target=False)
        head.load_public_state(state, grow=layers > held)
        return head

    def _head(self, embed, lm_head, d2t, layers: int, *, init_from_target: bool) -> EagleTrainHead:
        cfg = self.cfg
        if d2t is not None:
            self.head_config["draft_vocab_size"] = len(d2t)
        self.head_config["num_hidden_layers"] = layers
        inv_freq, scaling = inverse_frequencies(cfg.head_target_dir)
        longest = cfg.data.max_prompt_tokens + cfg.data.max_new_tokens + max(cfg.ttt_steps, cfg.eval_chain) + 1
        cos, sin = rope_tables(inv_freq, scaling, longest)
        torch.manual_seed(cfg.seed)
        head = EagleTrainHead(self.head_config, embed, lm_head, cos, sin, d2t)
        if init_from_target:
            init_from_target_layer(head, target_last_layer(cfg.head_target_dir))
        return head

    def loss(self, head: EagleTrainHead, batch: Batch, with_hits: bool = True) -> tuple[torch.Tensor, dict]:
        """with_hits: also the depth-1 top-1 accuracy of the batch (metrics["top1"]; a pass of its own)."""
        total, metrics = 0.0, {}
        for s, predicted in enumerate(head.unroll(batch.tokens, batch.features, self.cfg.ttt_steps)):
            mask = batch.answer_mask(s + 2)  # pair i predicts f_{i+s+1} and t_{i+s+2}, an answer token
            wanted = shifted(batch.features, s + 1)[mask]  # f_{i+s+1}: its logits are the target's for t_{i+s+2}
            feature_loss = F.smooth_l1_loss(predicted[mask].float(), wanted)
            labels = head.draft_labels(shifted(batch.tokens, s + 2)[mask])
            ce, hits = self._token_loss(head, predicted[mask], wanted, labels, with_hits and s == 0)
            total = total + STEP_DECAY**s * (feature_loss + self.cfg.ce_weight * ce)
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
            for s, predicted in enumerate(head.unroll(batch.tokens, batch.features, self.cfg.eval_chain)):
                top = head.to_target_ids(chunked_topk(predicted[anchors], head.lm_head, max(TREE_WIDTHS)))
                wanted = shifted(batch.tokens, s + 2, fill=IGNORE)[anchors]
                valid = batch.answer_mask(s + 2)[anchors]
                ranks.append(draft_ranks(top, wanted, valid))
                accept = sampled_acceptance(predicted[anchors], head.lm_head, shifted(batch.features, s + 1)[anchors],
                                            self._target_lm_head(head), head.d2t)
                accepts.append(accept * valid)
            parts.append(_chain_metrics(ranks, anchor_rows(anchors)) | _sampled_sums(accepts))
        return _merge(parts)

    def _target_lm_head(self, head: EagleTrainHead) -> torch.Tensor:
        """The target's whole lm_head: the head's own without a pruned vocabulary, else read once."""
        if head.d2t is None:
            return head.lm_head
        if self._lm_head is None:
            self._lm_head = target_embeddings(self.cfg.head_target_dir, self.dtype)[1]
        return self._lm_head

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
            parts.append(_chain_metrics(ranks, rows))
            all_ranks.append(torch.stack(ranks))
            all_rows.append(rows + seen)
            seen += len(anchors)
        trees = static_tree_metrics(torch.cat(all_ranks, 1), torch.cat(all_rows), STATIC_TREE_WIDTH)
        return _merge(parts) | {"static_trees": trees}

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
