"""Token trees: the draft tokens of one verify step as a tree (pure: ints and CPU tensors).

Words:
- node: one input position of the verify forward pass. Node 0 is the root: the last accepted
  token, whose target logits row scores the depth-1 draft tokens. Nodes 1..N-1 are draft tokens.
- parent: `parents[i]`, the node whose row scores node i's token; `parents[0] = -1`. Nodes are in
  topological order: `parents[i] < i`, so a node's ancestors all come before it.
- children: the nodes whose parent is i, in index order. Siblings (children of one node) carry
  distinct tokens, and verification tries them in that order.
- depth: 0 for the root, parent's depth + 1 otherwise. It is also the node's position offset: node i
  sits at position `root_position + depth[i]` for RoPE, whatever its index.
- path: the nodes from the root down to a node (`path_to`); a leaf is a node without children, and
  `paths()` lists the root-to-leaf paths. Each path is one chain of drafts.
- attention mask: node i attends to node j iff j is i or an ancestor of i; the tree is causal along
  each path and blind across branches. (Every node also attends to the whole KV prefix before the
  root; the mask covers the tree part only.)
- Medusa choices: a static tree shape. Each choice is a tuple of top-k ranks, one per depth: (1,) is
  the second most likely depth-1 token, (1, 0) the most likely depth-2 token under it. Medusa heads
  predict each depth from the same hidden state, so the token of (r_1, ..., r_d) is
  `topk_tokens[d - 1][r_d]`, the same under every parent.
- dynamic tree (EAGLE-2): grown depth by depth from the draft's own probabilities; see
  `grow_dynamic_tree`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

Choice = tuple[int, ...]


@dataclass(frozen=True)
class TokenTree:
    """N nodes given by parent pointers and tokens; node 0 is the root (see the module words)."""

    parents: tuple[int, ...]  # [N], parents[0] = -1, parents[i] < i
    tokens: tuple[int, ...]  # [N] token ids; tokens[0] is the last accepted token
    depths: tuple[int, ...] = field(init=False, repr=False, compare=False)
    children: tuple[tuple[int, ...], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        parents, tokens = tuple(int(p) for p in self.parents), tuple(int(t) for t in self.tokens)
        assert len(parents) >= 1 and len(parents) == len(tokens), "one parent per token, N >= 1"
        assert parents[0] == -1, "node 0 is the root: parents[0] must be -1"
        for i, p in enumerate(parents[1:], start=1):
            assert 0 <= p < i, f"parents must be topological: parents[{i}] = {p} is not in [0, {i})"
        assert all(t >= 0 for t in tokens), "token ids are >= 0"
        depths = [0] * len(parents)
        children: list[list[int]] = [[] for _ in parents]
        for i, p in enumerate(parents[1:], start=1):
            depths[i] = depths[p] + 1
            children[p].append(i)
        for i, kids in enumerate(children):
            kid_tokens = [tokens[c] for c in kids]
            assert len(set(kid_tokens)) == len(kids), f"siblings under node {i} repeat a token"
        object.__setattr__(self, "parents", parents)
        object.__setattr__(self, "tokens", tokens)
        object.__setattr__(self, "depths", tuple(depths))
        object.__setattr__(self, "children", tuple(tuple(kids) for kids in children))

    def __len__(self) -> int:
        return len(self.parents)

    @property
    def num_drafts(self) -> int:
        """Draft tokens: every node but the root."""
        return len(self.parents) - 1

    @property
    def max_depth(self) -> int:
        return max(self.depths)

    @property
    def leaves(self) -> tuple[int, ...]:
        """Nodes without children, in index order."""
        return tuple(i for i, kids in enumerate(self.children) if not kids)

    def path_to(self, node: int) -> tuple[int, ...]:
        """The node indices from the root down to `node`, both included."""
        assert 0 <= node < len(self), f"node {node} is not in a tree of {len(self)} nodes"
        path = []
        while node >= 0:
            path.append(node)
            node = self.parents[node]
        return tuple(reversed(path))

    def paths(self) -> tuple[tuple[int, ...], ...]:
        """The root-to-leaf paths, one per leaf, in leaf index order."""
        return tuple(self.path_to(leaf) for leaf in self.leaves)

    def attention_mask(self) -> Tensor:
        """[N, N] bool: row i is True at column j iff j is i or an ancestor of i."""
        n = len(self)
        mask = torch.zeros(n, n, dtype=torch.bool)
        for i, p in enumerate(self.parents):
            if p >= 0:
                mask[i] = mask[p]  # rows of ancestors are complete before their descendants
            mask[i, i] = True
        return mask

    def positions(self, root_position: int = 0) -> Tensor:
        """[N] int64 RoPE positions: `root_position + depth`."""
        return torch.tensor(self.depths, dtype=torch.long) + root_position


def chain(tokens: Sequence[int]) -> TokenTree:
    """The degenerate tree of a draft chain: tokens[0] the root, then each token under the last."""
    assert len(tokens) >= 1, "a chain holds at least the root"
    return TokenTree(parents=tuple(range(-1, len(tokens) - 1)), tokens=tuple(tokens))


# --- static trees (Medusa choices) -----------------------------------------------------------


def chain_choices(k: int) -> tuple[Choice, ...]:
    """The Medusa choices of a chain of k drafts: (0,), (0, 0), ..., the top-1 token per depth."""
    assert k >= 0
    return tuple((0,) * d for d in range(1, k + 1))


MEDUSA_CHAIN_4: tuple[Choice, ...] = chain_choices(4)

# A small static tree of 10 drafts, widest near the root where the draft is most often right,
# in the spirit of Medusa's `mc_sim_7b_63` (which has 63 nodes).
SMALL_STATIC_TREE: tuple[Choice, ...] = (
    (0,), (1,), (2,),
    (0, 0), (0, 1), (1, 0),
    (0, 0, 0), (0, 0, 1), (0, 1, 0),
    (0, 0, 0, 0),
)  # fmt: skip


def sorted_choices(choices: Sequence[Sequence[int]]) -> tuple[Choice, ...]:
    """Medusa's canonical order: by depth, then by ranks; checks the set is a tree.

    Every prefix of a choice must be a choice too (a node's parent is in the tree), there are no
    repeats, and ranks are >= 0.
    """
    ordered = tuple(sorted((tuple(int(r) for r in c) for c in choices), key=lambda c: (len(c), c)))
    known = set(ordered)
    assert len(known) == len(ordered), "Medusa choices repeat a node"
    for c in ordered:
        assert len(c) >= 1 and all(r >= 0 for r in c), f"choice {c}: ranks are >= 0, depth >= 1"
        assert len(c) == 1 or c[:-1] in known, f"choice {c}: its parent {c[:-1]} is not a choice"
    return ordered


def from_medusa_choices(
    choices: Sequence[Sequence[int]],
    topk_tokens: Sequence[Sequence[int]] | Tensor,
    root_token: int,
) -> TokenTree:
    """The static tree of Medusa `choices` with candidate tokens from per-depth top-k lists.

    choices: Medusa choices (see the module words), any order; nodes follow `sorted_choices`, so
        node i + 1 is the i-th sorted choice.
    topk_tokens: [D, K] the top-K token ids of each depth (Medusa head d - 1 for depth d), highest
        first: `topk_tokens[d - 1][r]` is the token of a depth-d choice ending in rank r. The
        ranks under one parent are distinct, so siblings carry distinct tokens when each depth's
        top-K ids are distinct.
    root_token: the last accepted token.
    """
    ordered = sorted_choices(choices)
    rows = topk_tokens.tolist() if isinstance(topk_tokens, Tensor) else topk_tokens
    index = {c: i + 1 for i, c in enumerate(ordered)}
    parents, tokens = [-1], [int(root_token)]
    for c in ordered:
        assert len(c) <= len(rows), f"choice {c} is deeper than the {len(rows)} top-k lists"
        assert c[-1] < len(rows[len(c) - 1]), f"choice {c}: rank {c[-1]} is beyond top-k"
        parents.append(index[c[:-1]] if len(c) > 1 else 0)
        tokens.append(int(rows[len(c) - 1][c[-1]]))
    return TokenTree(parents=tuple(parents), tokens=tuple(tokens))


# --- dynamic trees (EAGLE-2) -----------------------------------------------------------------

# expand(frontier) -> one (token_ids [c], logprobs [c]) pair per frontier candidate, c <= top_k.
Expand = Callable[[Sequence[int]], Sequence[tuple[Tensor, Tensor]]]


@dataclass(frozen=True)
class DynamicTree:
    """A grown tree and, per node, where it came from among the candidates of the growth.

    dist_rows[i]: the expansion row of node i, the index of the draft distribution that scored
        node i's children (rows count every expanded candidate from 0, in expansion order: the
        root is row 0, and one `expand` call's rows follow its frontier); -1 when node i was never
        expanded. Node i's own token was drawn from row `dist_rows[parents[i]]`, always >= 0.
    candidate_ids[i]: node i's candidate id during the growth (the ids `expand` saw).
    scores[i]: node i's cumulative draft log-probability along its path (the root's is 0).
    """

    tree: TokenTree
    dist_rows: tuple[int, ...]  # [N]
    candidate_ids: tuple[int, ...]  # [N], increasing
    scores: tuple[float, ...]  # [N], non-increasing along every path


def grow_dynamic_tree(
    root_token: int, expand: Expand, *, top_k: int, depth: int, node_budget: int, per_depth: bool = False
) -> DynamicTree:
    """Grow an EAGLE-2 tree: expand the best frontier per depth, keep the best nodes overall.

    A candidate's score is the cumulative draft log-probability of its path, the draft's estimate
    of the chance the target accepts it. Depth 1: the root is expanded. Each later depth: the
    `top_k` best-scored candidates of the previous depth (the frontier) are expanded. `expand` is
    called `depth` times. Finally the `node_budget` best-scored candidates are kept as drafts.

    per_depth: keep each depth's frontier instead, depth by depth, until the budget is spent (the
    last kept depth keeps its best). For children sampled without replacement and scored by rank
    (the j-th child by the j-th largest draft probability, not its own), whether a node is kept
    then never depends on its own token, nor on anything drawn below it: each depth's scores come
    from the draws above it. Recursive rejection needs exactly that to stay lossless (the kept
    children of a node are the first of its draws, however many). The overall rerank lacks it: a
    node's own draw scores its children, which may take budget from its cousins and so decide
    whether the node itself is kept.

    expand(frontier): frontier holds candidate ids. Ids are given in creation order: the root is
        0, and the children returned by one call get the next ids, frontier candidate by frontier
        candidate, each in its returned order; the callback tracks what it needs (tokens, hidden
        states) by these ids. It returns, per frontier candidate, (token_ids [c] int, logprobs
        [c] float): that candidate's children, usually its draft's top-k, 1 <= c <= top_k,
        distinct ids, log-probabilities <= 0 (they make scores fall along a path).
    Ties in score go to the lower id. Since a child scores at most its parent and has a higher id,
    the kept set is ancestor-closed: a kept node's parent is kept too.
    """
    assert top_k >= 1 and depth >= 1 and node_budget >= 0
    parents, tokens, scores = [-1], [int(root_token)], [0.0]
    expanded: dict[int, int] = {}  # candidate id -> expansion row
    frontier, frontiers = [0], []
    for _ in range(depth):
        children = expand(frontier)
        assert len(children) == len(frontier), "expand returns one child list per frontier node"
        layer = []
        for node, (token_ids, logprobs) in zip(frontier, children, strict=True):
            expanded[node] = len(expanded)
            for token_id, logprob in _checked_children(token_ids, logprobs, top_k):
                layer.append(len(parents))
                parents.append(node)
                tokens.append(token_id)
                scores.append(scores[node] + logprob)
        frontier = _best(layer, scores, top_k)
        frontiers.extend(frontier)
    best = frontiers[:node_budget] if per_depth else _best(range(1, len(parents)), scores, node_budget)
    kept = sorted([0, *best])
    return _kept_tree(kept, parents, tokens, scores, expanded)


def _checked_children(token_ids: Tensor, logprobs: Tensor, top_k: int) -> list[tuple[int, float]]:
    """token_ids: [c] int; logprobs: [c] float; returns the (token id, logprob) pairs."""
    assert token_ids.dim() == 1 and tuple(logprobs.shape) == tuple(token_ids.shape)
    ids, lps = token_ids.tolist(), logprobs.tolist()
    assert 1 <= len(ids) <= top_k, f"expand returned {len(ids)} children, top_k is {top_k}"
    assert len(set(ids)) == len(ids), "expand returned repeated children"
    assert all(lp <= 0.0 for lp in lps), "children log-probabilities must be <= 0 (and not NaN)"
    return [(int(t), float(lp)) for t, lp in zip(ids, lps, strict=True)]


def _best(candidates: Sequence[int] | range, scores: Sequence[float], n: int) -> list[int]:
    """The n best-scored candidates, ties to the lower id."""
    return sorted(candidates, key=lambda c: (-scores[c], c))[:n]


def _kept_tree(
    kept: list[int],
    parents: list[int],
    tokens: list[int],
    scores: list[float],
    expanded: dict[int, int],
) -> DynamicTree:
    """Renumber the kept candidates (sorted ids, root first) into a DynamicTree."""
    node_of = {c: i for i, c in enumerate(kept)}
    assert all(parents[c] in node_of for c in kept[1:]), "the kept set must be ancestor-closed"
    tree = TokenTree(
        parents=tuple(-1 if c == 0 else node_of[parents[c]] for c in kept),
        tokens=tuple(tokens[c] for c in kept),
    )
    return DynamicTree(
        tree=tree,
        dist_rows=tuple(expanded.get(c, -1) for c in kept),
        candidate_ids=tuple(kept),
        scores=tuple(scores[c] for c in kept),
    )
