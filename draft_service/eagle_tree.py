"""EAGLE-2 dynamic tree drafting: grows one token tree per sequence from the head's own
probabilities, every depth of every sequence in one batched forward.

Positions: the draft's KV position i holds the pair (f_i, t_{i+1}). Once a call has absorbed its
real pairs, a sequence has L real positions; the last, L - 1, holds the pending token t_L (the
last one the target sampled): the tree's root, depth 0. A node at depth d is the pair (its
parent's predicted feature, its token) at position L - 1 + d, just as a chain's draft token j
sits at L - 1 + j.

Expanding a node scores its children with the head's logits on the node's predicted feature.
The root's is the output of the last real pair; any other node gets its own when it is expanded:
it is appended to the KV as a speculative position (popped by the next call) that sees the real
prefix and, among the speculative positions, only its ancestors and itself (a TreeInput whose
mask spans all the sequence's speculative positions). Nodes never expanded are never appended.

Scores: log-probabilities of the sequence's proposal distribution (the request's temperature,
top-k/p, min-p and logit bias; penalties ignored); greedy requests use the log-softmax of the
processed (raw, unless biased) logits. Greedy requests: children are the top-k, chosen
deterministically, and the overall best nodes are kept (EAGLE-2); the target verifies them as
deterministic children. Sampled requests: children are drawn without replacement from the
proposal (SpecInfer, Sequoia), the j-th scored by the j-th largest probability rather than its
own, and each depth's frontier is kept (`per_depth`), so that recursive rejection with the
proposals, which the target gets one row per node, stays lossless. At temperature 1 this accepts
more than top-k children verified as point masses: served with the shipped head (10 MT-bench
questions, bench/results/shapes-20261203-183419 against -170930), a depth-4 tree of top-8 and 30
nodes accepts 1.90 tokens a verify against 1.52.

Lock step: tandem.spec.token_tree.grow_dynamic_tree grows one tree and calls back for each
expansion. It is pure and deterministic, so each round replays every sequence's growth from the
start with the answers given so far until it asks for one more (_Pause) or returns its tree;
the round then answers all the new requests with one forward and one lm_head call.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from tandem.kv.batching import TreeInput
from tandem.sampling.sampler import PROPOSAL_WIRE_DTYPE, draw_without_replacement, probabilities, process_logits, wire_proposal
from tandem.sampling.state import SamplingState
from tandem.spec.token_tree import DynamicTree, TokenTree, grow_dynamic_tree
from tandem.structured.drafting import DraftWalk, first_allowed, masked, point_mass

# forward(items, trees): items are (seq_id, tokens [n], features [n, D]); appends them to the
# KV as speculative positions and returns each item's predicted features, [n, D].
NodeForward = Callable[[list[tuple[int, list[int], Tensor]], dict[int, TreeInput]], list[Tensor]]


@dataclass(frozen=True, slots=True)
class TreeRoot:
    """Where one sequence's tree starts."""

    token: int  # the pending token t_L, of the last real pair
    feature: Tensor  # [D]: the predicted feature of the last real pair
    position: int  # L - 1, the last real pair's position
    depth: int  # depth cap (DraftSeq.num_tokens)


@dataclass(slots=True)
class _Growth:
    """One sequence's growth: its candidates by candidate id (the ids grow_dynamic_tree uses)."""

    root: TreeRoot
    tokens: list[int]
    parents: list[int]
    depths: list[int]
    features: dict[int, Tensor]  # expanded candidate -> its predicted feature [D]
    appended: list[int] = field(default_factory=list)  # candidates in speculative KV order
    answers: list = field(default_factory=list)  # one expand answer per finished round
    sampled: bool = False  # children drawn from the proposal (else its top-k)
    proposals: list[Tensor] = field(default_factory=list)  # sampled: [V] per expansion row
    tree: DynamicTree | None = None

    @staticmethod
    def start(root: TreeRoot, sampled: bool) -> "_Growth":
        return _Growth(root, [root.token], [-1], [0], {0: root.feature}, sampled=sampled)

    def draft_probs(self) -> Tensor | None:
        """Sampled trees: [N, V], row i the proposal node i's children were drawn from (zero for
        leaves); None for greedy trees."""
        if not self.sampled:
            return None
        tree, rows = self.tree.tree, self.tree.dist_rows
        first = self.proposals[0]
        probs = torch.zeros(len(tree), first.shape[0], dtype=first.dtype, device=first.device)
        for i, kids in enumerate(tree.children):
            if kids:
                probs[i] = self.proposals[rows[i]]
        return probs


@dataclass(frozen=True, slots=True)
class DraftTree:
    """One sequence's grown tree and, when its children were sampled, their proposals."""

    grown: DynamicTree
    probs: Tensor | None  # [N, V] (see _Growth.draft_probs)


class _Pause(Exception):
    """Raised by a replayed expand that has no answer yet; carries its frontier."""

    def __init__(self, frontier: Sequence[int]):
        super().__init__()
        self.frontier = tuple(frontier)


def grow_trees(
    roots: dict[int, TreeRoot],
    head,
    states: dict[int, SamplingState],
    forward: NodeForward,
    *,
    top_k: int,
    node_budget: int,
    walks: dict[int, DraftWalk] | None = None,
) -> dict[int, DraftTree]:
    """One EAGLE-2 tree per sequence (seq_id -> tree); states hold the proposal params and, for
    sampled requests, the generators the children are drawn with. walks: the constrained
    sequences' grammars (see the module doc of tandem.structured.drafting): each node's children
    come from the masked distribution of its path, and a root whose grammar forces tokens gets
    them as its tree, a chain grown with no head step."""
    walks = walks or {}
    trees = {s: _forced_tree(roots[s], walks[s], node_budget) for s in roots if s in walks}
    trees = {s: t for s, t in trees.items() if t is not None}
    growths = {s: _Growth.start(r, not states[s].params.greedy) for s, r in roots.items() if s not in trees}
    while frontiers := _next_frontiers(growths, top_k, node_budget):
        _append(growths, frontiers, forward)
        _answer(growths, frontiers, head, states, top_k, walks)
    return {**trees, **{s: DraftTree(g.tree, g.draft_probs()) for s, g in growths.items()}}


def _forced_tree(root: TreeRoot, walk: DraftWalk, node_budget: int) -> DraftTree | None:
    """The chain of tokens the grammar forces after the root (the root alone when it is stopped:
    only EOS may follow); None when nothing is forced. Its nodes are verified as deterministic
    children (no proposals): a point mass each, exact."""
    if walk.stopped:
        run = []
    elif not (run := walk.forced(min(root.depth, node_budget))):
        return None
    n = len(run) + 1
    tree = TokenTree(parents=tuple(range(-1, n - 1)), tokens=(root.token, *run))
    grown = DynamicTree(tree=tree, dist_rows=(*[-1] * n,), candidate_ids=tuple(range(n)), scores=(0.0,) * n)
    return DraftTree(grown, None)


def _next_frontiers(growths: dict[int, _Growth], top_k: int, node_budget: int) -> dict[int, tuple[int, ...]]:
    """Replays every unfinished growth: seq_id -> the frontier it asks to expand next."""
    frontiers = {}
    for s, g in growths.items():
        if g.tree is None:
            frontier = _replay(g, top_k, node_budget)
            if frontier is not None:
                frontiers[s] = frontier
    return frontiers


def _replay(g: _Growth, top_k: int, node_budget: int) -> tuple[int, ...] | None:
    """The frontier of g's next expansion, or None when g is done (g.tree set)."""
    answers = iter(g.answers)

    def expand(frontier):
        answer = next(answers, None)
        if answer is None:
            raise _Pause(frontier)
        return answer

    try:
        g.tree = grow_dynamic_tree(g.root.token, expand, top_k=top_k, depth=g.root.depth,
                                   node_budget=node_budget, per_depth=g.sampled)
    except _Pause as pause:
        return pause.frontier
    return None


def _append(growths: dict[int, _Growth], frontiers: dict[int, tuple[int, ...]], forward: NodeForward) -> None:
    """Runs the frontier nodes (the root excepted: it is real) as speculative positions."""
    new = {s: [c for c in frontier if c != 0] for s, frontier in frontiers.items()}
    new = {s: nodes for s, nodes in new.items() if nodes}
    if not new:
        return
    items, trees = [], {}
    for s, nodes in new.items():
        g = growths[s]
        items.append((s, [g.tokens[c] for c in nodes], torch.stack([g.features[g.parents[c]] for c in nodes])))
        trees[s] = _tree_input(g, nodes)
    for (s, _, _), out in zip(items, forward(items, trees), strict=True):
        growths[s].features.update(zip(new[s], out))
        growths[s].appended.extend(new[s])


def _tree_input(g: _Growth, new: list[int]) -> TreeInput:
    """New nodes over the span of all g's speculative positions, these included: each sees its
    speculative ancestors and itself."""
    span = g.appended + new
    mask = torch.zeros(len(new), len(span), dtype=torch.bool)
    for row, c in enumerate(new):
        lineage = _lineage(g, c)
        mask[row] = torch.tensor([a in lineage for a in span])
    return TreeInput(tuple(g.depths[c] for c in new), mask, root_position=g.root.position)


def _lineage(g: _Growth, c: int) -> set[int]:
    """c and its ancestors, the root excluded."""
    nodes = set()
    while c > 0:
        nodes.add(c)
        c = g.parents[c]
    return nodes


def _answer(growths, frontiers, head, states, top_k: int, walks: dict[int, DraftWalk]) -> None:
    """Scores every frontier node's children in one lm_head call; records them as candidates.
    Greedy rows of raw logits (no logit bias) rank the draft vocabulary's scores as they come:
    their log-softmax is the whole row's, whose other tokens are at -inf. The others are widened
    to the whole vocabulary and processed first."""
    rows = [(s, c) for s, frontier in frontiers.items() for c in frontier]
    features = torch.stack([growths[s].features[c] for s, c in rows])
    scores = head.scores(features)
    allowed = {i: _allowed(growths[s], c, walks[s]) for i, (s, c) in enumerate(rows) if s in walks}
    if allowed:
        scores = masked(scores, _mask_rows(allowed, scores.shape[0], head.vocab_size, head.vocab_ids))
    empty = {i for i in allowed if not bool(torch.isfinite(scores[i]).any())}
    children = {i: _fallback_child(growths[rows[i][0]], allowed[i]) for i in empty}
    ranked = [i for i, (s, _) in enumerate(rows) if not growths[s].sampled and _raw(states[s]) and i not in empty]
    if ranked:
        children.update(zip(ranked, _top_children(scores[ranked], top_k, head.vocab_ids)))
    widened = [i for i in range(len(rows)) if i not in children]
    if widened:
        logits = head.widen(scores[widened])
        if allowed:
            logits = masked(logits, _mask_rows(allowed, len(rows), head.vocab_size)[widened])
        children.update(_widened_children(growths, rows, widened, logits, states, top_k))
    answers = {s: [] for s in frontiers}
    for i, (s, c) in enumerate(rows):
        _add_children(growths[s], c, children[i][0].tolist())
        answers[s].append(children[i])
    for s, answer in answers.items():
        growths[s].answers.append(answer)


def _allowed(g: _Growth, c: int, walk: DraftWalk) -> Tensor:
    """[V] bool: what the grammar allows after candidate c's path."""
    path = []
    while c > 0:
        path.append(g.tokens[c])
        c = g.parents[c]
    walk.to(path[::-1])
    return walk.allowed()


def _mask_rows(allowed: dict[int, Tensor], num_rows: int, vocab_size: int, vocab_ids: Tensor | None = None) -> Tensor:
    """[num_rows, V] bool (or [num_rows, V'] over a draft vocabulary): row i `allowed[i]`, all
    allowed for an unconstrained row."""
    rows = torch.ones(num_rows, vocab_size, dtype=torch.bool)
    for i, row in allowed.items():
        rows[i] = row
    return rows if vocab_ids is None else rows[:, vocab_ids.cpu()]


def _fallback_child(g: _Growth, allowed: Tensor) -> tuple[Tensor, Tensor]:
    """A node whose draft vocabulary holds no allowed token still needs a child: the lowest
    allowed token, scored -inf (kept only if the budget has room), a point mass if sampled."""
    token = first_allowed(allowed)
    if g.sampled:  # its expansion row, in frontier order
        g.proposals.append(point_mass(token, allowed.shape[0], PROPOSAL_WIRE_DTYPE))
    return torch.tensor([token]), torch.tensor([float("-inf")])


def _raw(state: SamplingState) -> bool:
    """Whether the state leaves logits as they are (penalties are off in every draft state)."""
    return not state.params.logit_bias and not state.needs_penalties


def _widened_children(growths, rows, widened: list[int], logits: Tensor, states, top_k: int) -> dict:
    """The children of rows `widened` (indices into rows), from their logits over the whole
    vocabulary [len(widened), V]: greedy rows' top-k, sampled rows' draws from the proposal."""
    processed = process_logits(logits, [states[rows[i][0]] for i in widened])
    greedy = [j for j, i in enumerate(widened) if not growths[rows[i][0]].sampled]
    sampled = [j for j, i in enumerate(widened) if growths[rows[i][0]].sampled]
    children = {}
    if greedy:
        children.update(zip([widened[j] for j in greedy], _top_children(processed[greedy], top_k)))
    if sampled:
        seqs = [rows[widened[j]][0] for j in sampled]
        proposals = wire_proposal(probabilities(processed[sampled], [states[s] for s in seqs]))
        for j, s, proposal in zip(sampled, seqs, proposals, strict=True):
            growths[s].proposals.append(proposal)  # in frontier order: the sequence's expansion rows
            children[widened[j]] = _drawn_children(proposal, top_k, states[s].generator)
    return children


def _top_children(processed: Tensor, top_k: int, vocab_ids: Tensor | None = None) -> list[tuple[Tensor, Tensor]]:
    """Greedy rows [R, V] (or [R, V'] of a draft vocabulary, column j token vocab_ids[j]): each
    row's top-k tokens and their log-softmax scores."""
    values, ids = torch.log_softmax(processed, dim=-1).topk(min(top_k, processed.shape[1]), dim=-1)
    if vocab_ids is not None:
        ids = vocab_ids[ids]
    out = []
    for row_values, row_ids in zip(values.cpu(), ids.cpu(), strict=True):
        keep = row_values > float("-inf")
        keep[0] = True  # the top token always has a positive probability
        out.append((row_ids[keep], row_values[keep].clamp_max(0.0)))
    return out


def _drawn_children(proposal: Tensor, top_k: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """A sampled row: up to top_k tokens drawn without replacement from the proposal [V], the
    j-th scored by the log of the j-th largest probability, not its own (see the module doc)."""
    ids = draw_without_replacement(proposal, top_k, generator)
    scores = proposal.topk(len(ids)).values.float().log().clamp_max(0.0)
    return ids.cpu(), scores.cpu()


def _add_children(g: _Growth, parent: int, tokens: list[int]) -> None:
    """New candidates get the next ids, in order, as grow_dynamic_tree numbers them."""
    for token in tokens:
        g.tokens.append(token)
        g.parents.append(parent)
        g.depths.append(g.depths[parent] + 1)
