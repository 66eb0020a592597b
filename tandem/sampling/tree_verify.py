"""Lossless verification of one sequence's draft token tree (pure tensor code).

The tree generalises the chain of `tandem.sampling.verify` (same words, same `VerifiedToken`s):
- target distribution p_i: what the target alone would sample after node i,
  `probabilities(process_logits(row i))`, with the drafts on the path to i counted as outputs by
  the penalties.
- accepted tokens: the drafts along one root-down path. The walk starts at the root; at node i
  it tries i's children in index order, and moves to the first one it accepts. Greedy: the child
  whose token is the argmax of row i (tokens of siblings are distinct, so at most one).
- recovered token: emitted at a node with children when none is accepted. bonus token: emitted at
  a leaf reached by the walk. Greedy: the argmax of that node's row. Sampling: see below.
Every step emits `num_accepted + 1` tokens, distributed exactly as if the target had sampled them
one by one. Logprobs are raw, as in verify_chain.

Sampling: recursive rejection sampling over siblings (SpecInfer, EAGLE, Sequoia). At node i, with
r = p_i, try the children c_1, c_2, ... in order. Child c_j with token t is accepted with
probability min(1, r(t) / q_j(t)); on rejection r <- norm(max(r - q_j, 0)) and the next sibling is
tried. If all are rejected, the recovered token is drawn from the final r; an accepted child
continues the walk from its own p. The siblings' proposals q_j depend on how the draft chose them:
- sampled children (`draft_probs` given): drawn one after another WITHOUT replacement from the
  draft distribution q of node i: c_1 ~ q, c_2 ~ q with c_1 removed and renormalised, and so on.
  So q_1 = q and q_{j+1} = q_j with t zeroed and renormalised. A chain is the one-child case:
  exactly verify_chain's rule, drawing the same random numbers.
- deterministic children (`draft_probs` None): chosen by the draft without sampling, as the top-k
  tokens of Medusa static trees and EAGLE-2 dynamic trees are. Each child is its own point mass,
  q_j = one-hot(t): accept t with probability r(t), on rejection zero r(t) and renormalise
  (EAGLE's tree sampling rule).
Keyed (a seeded request, `params.keyed`): the greedy walk over each row's keyed draw at the
node's token index (tandem.sampling.keyed); the output equals plain decoding's.
Why it is exact: for one sibling c ~ q_j, accepting with min(1, r / q_j) gives token x with
probability min(r(x), q_j(x)); the rest, 1 - sum(min(r, q_j)) = sum(max(r - q_j, 0)), goes to
norm(max(r - q_j, 0)) by induction over the remaining siblings, which are drawn from q_{j+1}
whatever the rejected one was. The sum is r(x). Exactness needs the kept children of a node to be
its first draws, and whether a child is kept not to depend on its own token or on anything drawn
after it (it may depend on the tokens above it: EAGLE trees grown with `per_depth` keeps satisfy
this). Point masses need nothing of the kind: conditioned on whatever tree the draft sent, the
rule is exact, so any tree may be verified as deterministic, sampled ones included.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from tandem.sampling.keyed import keyed_token
from tandem.sampling.sampler import draw, masked, probabilities, process_logits
from tandem.sampling.state import SamplingState
from tandem.sampling.verify import VerifiedToken, VerifyResult, _verified_tokens, proper_proposal
from tandem.spec.token_tree import TokenTree

# node -> [V] draft distribution its children were drawn from, or [N, V] indexed by node.
DraftProbs = Mapping[int, Tensor] | Tensor


@dataclass(frozen=True, slots=True)
class TreeVerifyResult:
    """The outcome of verifying one sequence's token tree."""

    num_accepted: int  # draft tokens accepted, 0..max depth
    tokens: tuple[VerifiedToken, ...]  # accepted drafts + one recovered or bonus token
    accepted_nodes: tuple[int, ...]  # [num_accepted] tree nodes of the accepted drafts, root-down

    def as_verify_result(self) -> VerifyResult:
        """The chain view: what verify_chain would return for the accepted path."""
        return VerifyResult(num_accepted=self.num_accepted, tokens=self.tokens)


def verify_tree(
    target_logits: Tensor,
    tree: TokenTree,
    draft_probs: DraftProbs | None,
    state: SamplingState,
    first_index: int = 0,
    allowed: Tensor | None = None,
) -> TreeVerifyResult:
    """Accept the drafts along one path of the tree, emit one recovered or bonus token after them.

    target_logits: [N, V] raw target logits, any float dtype; row i scores the token after node i
        (the forward pass ran the N nodes with `tree.attention_mask()` and `tree.positions()`).
    tree: the N-node token tree; node 0 is the last accepted token.
    draft_probs: for sampled drafts, the distribution q each node's children were drawn from
        (without replacement, in child order): a mapping node -> [V] covering every node with
        children, or an [N, V] tensor whose rows of leaves are ignored. None: the children were
        chosen deterministically (top-k), verified as point masses. Ignored by greedy states.
    state: the sequence's sampling state. Its generator is consumed (sampling only); every
        emitted token is recorded with `observe_output`, in order.
    first_index: the index in its sequence of the token the root's row scores (keyed states);
        a node at depth d scores index first_index + d.
    allowed: [N, V] bool, the grammar's mask of each node's row (None: none), as in verify_chain:
        the rules run on the masked, renormalised p', so no node outside the grammar is accepted.
    """
    n, vocab_size = len(tree), state.vocab_size
    assert target_logits.dim() == 2 and tuple(target_logits.shape) == (n, vocab_size)
    assert all(t < vocab_size for t in tree.tokens), "tree tokens must be < the vocabulary size"
    rows = _PathRows(masked(target_logits, allowed), state)
    if state.params.greedy:
        accepted, last = _walk_greedy(rows, tree, lambda node: int(rows.processed(node).argmax()))
    elif state.params.keyed:
        depth = tree.depths
        keyed = lambda node: keyed_token(rows.processed(node), rows.probs(node), state.params, first_index + depth[node])  # noqa: E731
        accepted, last = _walk_greedy(rows, tree, keyed)
    else:
        q_of = _draft_probs_by_node(draft_probs, tree, vocab_size)
        accepted, last = _walk_sampled(rows, tree, q_of, state.generator)
    emitted = [*(tree.tokens[i] for i in accepted), last]
    for token_id in emitted:
        state.observe_output(token_id)
    row_ids = torch.tensor([0, *accepted], dtype=torch.long, device=target_logits.device)
    tokens = _verified_tokens(target_logits[row_ids], emitted, state.params.top_logprobs)
    return TreeVerifyResult(
        num_accepted=len(accepted), tokens=tokens, accepted_nodes=tuple(accepted)
    )


class _PathRows:
    """The processed logits and target distributions of the nodes the walk visits.

    Rows are computed lazily, one per visited node: the walk visits one path, not the whole tree.
    With penalties, node i's row depends on the drafts accepted on the way to it, so rows are
    processed against a scratch copy of the bookkeeping, which `accept` advances (as verify_chain
    does); the caller's state is never touched.
    """

    def __init__(self, target_logits: Tensor, state: SamplingState) -> None:
        # target_logits: [N, V] raw logits of the tree's nodes.
        self._logits = target_logits
        self._state = state
        self._scratch: SamplingState | None = None
        if state.needs_penalties:
            assert state.seen is not None and state.output_counts is not None
            self._scratch = copy.copy(state)  # shares the generator, never its bookkeeping
            self._scratch.seen = state.seen.clone()
            self._scratch.output_counts = state.output_counts.clone()
            self._state = self._scratch

    def processed(self, node: int) -> Tensor:
        """[V] float32 processed logits of the node's row."""
        return process_logits(self._logits[node : node + 1], [self._state])[0]

    def probs(self, node: int) -> Tensor:
        """[V] float32 target distribution p of the node's row."""
        return probabilities(self.processed(node)[None], [self._state])[0]

    def accept(self, token_id: int) -> None:
        """Count an accepted draft as an output for the rows below it."""
        if self._scratch is not None:
            self._scratch.observe_output(token_id)


def _walk_greedy(rows: _PathRows, tree: TokenTree, choose: Callable[[int], int]) -> tuple[list[int], int]:
    """Returns (accepted nodes, the recovered or bonus token): at each node, the child whose
    token is `choose(node)`, the target's own token of its row (its argmax, or its keyed draw)."""
    node, accepted = 0, []
    while True:
        best = choose(node)
        match = [c for c in tree.children[node] if tree.tokens[c] == best]
        if not match:
            return accepted, best  # recovered (or bonus at a leaf)
        node = match[0]
        accepted.append(node)
        rows.accept(best)


def _walk_sampled(
    rows: _PathRows,
    tree: TokenTree,
    q_of: Mapping[int, Tensor] | None,
    generator: torch.Generator,
) -> tuple[list[int], int]:
    """Returns (accepted nodes, the recovered or bonus token), drawing from `generator`.

    q_of: node -> [V] draft distribution of its children; None for deterministic children.
    """
    node, accepted = 0, []
    while True:
        p = rows.probs(node)  # [V]
        children = tree.children[node]
        if not children:
            return accepted, int(draw(p[None], [generator])[0])  # bonus
        q = None if q_of is None else q_of[node].to(device=p.device, dtype=torch.float32)
        child_tokens = [tree.tokens[c] for c in children]
        chosen, residual = _reject_siblings(p, q, child_tokens, generator)
        if chosen is None:
            return accepted, int(draw(residual[None], [generator])[0])  # recovered
        node = children[chosen]
        accepted.append(node)
        rows.accept(tree.tokens[node])


def _reject_siblings(
    p: Tensor, q: Tensor | None, child_tokens: list[int], generator: torch.Generator
) -> tuple[int | None, Tensor]:
    """Try the siblings in order; returns (index of the accepted one or None, the final residual).

    p: [V] target distribution of the parent's row. q: [V] the distribution the siblings were
    drawn from without replacement, or None for deterministic siblings (point masses).
    A rejection changes r only where q is positive, so r is kept unnormalised with its mass z and
    updated on q's support alone: a point mass costs one entry a sibling, a proposal cut to the
    draft's top N (--proposal-top-k) N entries, a whole one V.
    """
    r, z = p.clone(), float(p.sum())  # the residual is r / z
    if q is not None:
        support = q.nonzero().flatten()  # the siblings left are drawn from q_left / its mass
        q_left = q[support].float()
    for j, t in enumerate(child_tokens):
        if q is None:  # a point mass at t
            index, q_j = torch.tensor([t], device=p.device), torch.ones(1, device=p.device)
        else:
            index, q_j = support, q_left / q_left.sum()
        q_t = float(q_j[index == t].sum())
        assert q_t > 0, f"draft token {t} (child {j}) has draft probability 0"
        u = float(torch.rand(1, generator=generator, device=generator.device))
        # Accept t with probability min(1, r(t) / q(t)): where the target likes t at least as
        # much as the draft, keep it; elsewhere only in proportion r / q. On rejection the next
        # sibling (or the recovered token) serves norm(max(r - q, 0)), the mass q under-proposed.
        if u * q_t < float(r[t]) / z:
            return j, r / z
        before = r[index]
        after = (before - z * q_j).clamp_min_(0.0)  # max(r - q, 0), times z
        removed = float((before - after).sum())
        if z - removed > 0:  # else r == q numerically: keep r
            r[index] = after
            z -= removed
        if q is not None:  # the next sibling was drawn from q without t
            q_left[support == t] = 0.0  # no mass left: a next sibling fails its assert
    return None, r / z


def fits_sampled_tree(draft_probs: Tensor, tree: TokenTree) -> bool:
    """Whether draft_probs [N, V] can verify the tree's children as sampled: every node with
    children has a finite, non-negative row summing to 1 that gives each child's token positive
    probability. A row that does not (a faulty draft) must not reach verify_tree's asserts."""
    if draft_probs.dim() != 2 or draft_probs.shape[0] != len(tree):
        return False
    internal = [i for i, kids in enumerate(tree.children) if kids]
    if not internal:
        return True
    rows = draft_probs[internal].float()  # one pass over the rows the walk may read
    kids = [(r, tree.tokens[c]) for r, i in enumerate(internal) for c in tree.children[i]]
    return proper_proposal(rows, rows[[r for r, _ in kids], [t for _, t in kids]])


def _draft_probs_by_node(
    draft_probs: DraftProbs | None, tree: TokenTree, vocab_size: int
) -> Mapping[int, Tensor] | None:
    """Checks draft_probs against the tree; returns node -> [V] (or None: deterministic)."""
    if draft_probs is None:
        return None
    internal = [i for i, kids in enumerate(tree.children) if kids]
    if isinstance(draft_probs, Tensor):
        assert tuple(draft_probs.shape) == (len(tree), vocab_size), "draft_probs must be [N, V]"
        return {i: draft_probs[i] for i in internal}
    missing = [i for i in internal if i not in draft_probs]
    assert not missing, f"draft_probs lacks the nodes with children {missing}"
    assert all(tuple(draft_probs[i].shape) == (vocab_size,) for i in internal), "rows are [V]"
    return draft_probs
