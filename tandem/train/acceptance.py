"""Acceptance metrics of a draft head's evaluation, teacher-forced on the target's answers:
per-depth ranks of the target's tokens among the draft's, greedy chains, full top-k trees,
Medusa static trees, the walk a served greedy decode takes, and their one-line descriptions.

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

import torch

from tandem.spec.token_tree import SMALL_STATIC_TREE
from tandem.train.losses import accepted_lengths

TREE_WIDTHS = (2, 3)  # the full top-k trees evaluated next to the greedy chains
STATIC_TREE_WIDTH = 16  # Medusa: ranks a static tree built from the evaluation may use per head
STATIC_TREE_SIZES = (10, 30, 60)  # its node counts: the served default's size, and GPU sizes


def draft_ranks(top: torch.Tensor, wanted: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """top [A, K] the draft's best ids, wanted [A] the target's tokens, valid [A] where wanted is an
    answer token -> [A] the rank of wanted among top (K: absent, or not an answer token)."""
    hit = (top == wanted[:, None]) & valid[:, None]
    return torch.where(hit.any(1), hit.long().argmax(1), top.shape[1])


def anchor_rows(anchors: torch.Tensor) -> torch.Tensor:
    """anchors [N, L] bool -> [A] the sequence of each anchor, in the order anchors[mask] takes them."""
    return anchors.nonzero()[:, 0]


def chain_metrics(ranks: list[torch.Tensor], rows: torch.Tensor) -> dict:
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


def sampled_sums(accepts: list[torch.Tensor]) -> dict:
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


def merge_parts(parts: list[dict]) -> dict:
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
