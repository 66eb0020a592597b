"""The Medusa draft engine: no KV cache; per sequence only the last (feature, token) pair the
target streamed, the pair of its last accepted position, whose token is the pending token.

A Draft call (1) applies the sequence ops, (2) runs the heads on the last pair of every asked
sequence in one batched forward, (3) builds each sequence's static tree from the Medusa choices:
the root is the pending token, a depth-d choice ending in rank r takes head d - 1's r-th most
likely token. Drafts always come with tree parents (a chain too: 0, 1, 2, ...): the children
are chosen deterministically (top-k), so the target verifies them as a tree of deterministic
children, lossless for sampled requests as well; no draft probabilities are sent.

Like the EAGLE engine, a sequence drafts only from a pair that came since it last drafted (the
pair of the target's latest step for it); a sequence without one gets no drafts.
"""

import json
import threading
import time
from dataclasses import dataclass

import torch
from opentelemetry.trace import INVALID_SPAN, Span

from draft_service.config import DraftConfig
from draft_service.grammars import DraftGrammars
from draft_service.proposal import proposal_sampler
from draft_service.peer_client import wait_for_hidden_states
from tandem.errors import FailedPrecondition, InvalidArgument, NotFound
from tandem.figures import EngineFigures
from tandem.models.medusa import MedusaHeads, read_head_choices
from tandem.ops import AddSequence, DraftRequest, DraftResult, DraftSeq, EngineStats, ForkSequence, PopTokens, RemoveSequence
from tandem.router_streams import RouterStreams
from tandem.sampling.sampler import process_logits
from tandem.sampling.state import SamplingState
from tandem.spec import token_tree
from tandem.spec.token_tree import Choice, TokenTree, chain_choices, from_medusa_choices, sorted_choices
from tandem.structured.drafting import DraftWalk, masked


@dataclass(slots=True)
class _Seq:
    sampler: SamplingState  # for the logit bias; penalties off (they need a history)
    hidden: torch.Tensor | None = None  # [D] the feature of the last pair
    token: int = -1  # the pair's token: the pending token, the root of the next tree
    fresh: bool = False  # the pair came after this sequence last drafted


class MedusaDraftEngine:
    def __init__(self, config: DraftConfig, head: MedusaHeads, peer, tracing=None):
        """tracing: unused; Medusa runs no prefill on hidden states (no KV), only heads."""
        self.config = config
        self.head = head
        self.peer = peer
        self.device = torch.device(config.device)
        self.choices = medusa_choices(config, head.num_heads)
        self.topk = max(c[-1] for c in self.choices) + 1
        if self.topk > head.draft_vocab_size:
            raise InvalidArgument(f"medusa_choices use rank {self.topk - 1}, beyond the draft vocabulary of {head.draft_vocab_size}")
        self._pruned: dict[int, tuple[Choice, ...]] = {}  # depth -> choices no deeper
        self._seqs: dict[int, _Seq] = {}
        # Structured output: a constrained sequence's heads rank only what its grammar allows.
        self.grammars = DraftGrammars(config.target_model_dir, head.config.vocab_size, config.constrained_drafts)
        self._lock = threading.Lock()
        # A router's Drafts stream read through it drops every sequence at its end.
        self.router_streams = RouterStreams(self._lock, self._drop_sequences, "draft")
        self._steps = 0
        self._tokens_run = 0
        self.figures = EngineFigures()  # for /metrics and Stats

    @property
    def max_draft_tokens(self) -> int:
        """Tree nodes (draft tokens) per sequence per call, at most."""
        return len(self.choices)

    @property
    def shape(self) -> str:
        return "chain" if self.choices == chain_choices(len(self.choices)) else "tree"

    def stats(self) -> EngineStats:
        return self.figures.fill(EngineStats(0, 0, len(self._seqs), self._steps, self._tokens_run))

    def reset(self) -> EngineStats:
        with self._lock:
            self._drop_sequences()
        return self.stats()

    def _drop_sequences(self) -> None:
        self._seqs.clear()
        self.grammars.clear()
        self.peer.clear()

    def draft(self, request: DraftRequest, span: Span = INVALID_SPAN) -> DraftResult:
        with self._lock:
            started = time.perf_counter()
            wait_for_hidden_states(self.peer, request.after_target_step, self.config.hidden_timeout_s)
            for op in request.ops:
                self._apply(op)
            self.peer.retain(set(self._seqs))
            span.add_event("start draft")
            tokens, parents = self._draft(request.seqs) if request.seqs else ({}, {})
            span.add_event("finish draft")
            self._steps += 1
            seconds = time.perf_counter() - started
            self.figures.record_step(seconds, proposed=sum(len(t) for t in tokens.values()))
            return DraftResult(request.draft_step_id, tokens, seconds * 1e3, parents)

    # -- sequence ops -------------------------------------------------------------------------

    def _apply(self, op) -> None:
        if isinstance(op, AddSequence):
            self._add(op.seq_id, self._new_seq(op.sampler))
            self.grammars.added(op.seq_id, op.sampler, op.num_prompt_tokens)
        elif isinstance(op, ForkSequence):
            seq = self._new_seq(op.sampler)
            self._settle(op.parent_id)  # its buffered pairs precede the fork
            self._add(op.seq_id, seq)  # no pair of its own: it drafts once the target streams one
            self.grammars.forked(op.seq_id, op.parent_id, op.position, op.sampler, op.num_prompt_tokens)
        elif isinstance(op, PopTokens):
            seq = self._settle(op.seq_id)
            self.grammars.popped(op.seq_id, op.count)
            if op.count > 0:  # the last pair's position is gone
                seq.hidden, seq.fresh = None, False
        elif isinstance(op, RemoveSequence):
            if op.seq_id not in self._seqs:
                raise NotFound(f"draft: unknown sequence {op.seq_id}")
            del self._seqs[op.seq_id]
            self.grammars.removed(op.seq_id)
            self.peer.drop(op.seq_id)
        else:
            raise InvalidArgument(f"draft: unknown sequence op {op!r}")

    def _new_seq(self, params) -> _Seq:
        # Temperature and truncation do not change the top-k order: only the logit bias matters.
        return _Seq(proposal_sampler(params, len(self._seqs), self.config, self.head.config.vocab_size, self.device))

    def _add(self, seq_id: int, seq: _Seq) -> None:
        if seq_id in self._seqs:
            raise FailedPrecondition(f"sequence {seq_id} already exists")
        self._seqs[seq_id] = seq

    def _settle(self, seq_id: int) -> _Seq:
        """Absorbs the sequence's buffered pairs: keeps the last one."""
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise NotFound(f"draft: unknown sequence {seq_id}")
        for pairs in self.peer.take(seq_id):  # in step order
            self.grammars.absorbed(seq_id, pairs.start, pairs.tokens)
            if pairs.tokens:
                seq.hidden, seq.token, seq.fresh = pairs.hidden[-1].clone(), int(pairs.tokens[-1]), True
        return seq

    # -- drafting -----------------------------------------------------------------------------

    def _draft(self, seqs: tuple[DraftSeq, ...]) -> tuple[dict, dict]:
        for s in seqs:
            if s.seq_id not in self._seqs:
                raise InvalidArgument(f"draft: unknown sequence {s.seq_id}")
        tokens = {s.seq_id: () for s in seqs}
        parents = {s.seq_id: () for s in seqs}
        ready = []
        for s in seqs:
            seq = self._settle(s.seq_id)
            if s.num_tokens > 0 and seq.fresh and seq.hidden is not None:
                seq.fresh = False
                ready.append(s)
        if not ready:
            return tokens, parents
        states = [self._seqs[s.seq_id].sampler for s in ready]
        depths = [min(s.num_tokens, self.head.num_heads) for s in ready]
        heads = max(len(c) for c in self._within(max(depths)))  # the deepest tree's
        logits, top = self._top_tokens(torch.stack([self._seqs[s.seq_id].hidden for s in ready]), states, heads)
        for row, (s, depth) in enumerate(zip(ready, depths)):
            root = self._seqs[s.seq_id].token
            if (walk := self.grammars.walk(s.seq_id)) is not None:
                tree = constrained_tree(self._within(depth), logits[row], root, walk, self.topk)
                walk.close()
            else:
                tree = from_medusa_choices(self._within(depth), top[row], root_token=root)
            tokens[s.seq_id], parents[s.seq_id] = tree.tokens[1:], tree.parents[1:]
        return tokens, parents

    def _top_tokens(self, hidden: torch.Tensor, states: list[SamplingState], heads: int) -> tuple[torch.Tensor, list]:
        """hidden [S, D] -> (the first `heads` heads' logits after the request's logit bias
        [S, heads, V], their top-k token ids as nested lists [S][heads][K], most likely first)."""
        logits = self.head.logits(hidden, heads)  # [S, heads, V]
        self._tokens_run += hidden.shape[0]
        if any(state.params.logit_bias for state in states):
            heads = logits.shape[1]
            rows = [state for state in states for _ in range(heads)]
            logits = process_logits(logits.flatten(0, 1), rows).view(logits.shape)
        return logits, logits.topk(self.topk, dim=-1).indices.tolist()

    def _within(self, depth: int) -> tuple[Choice, ...]:
        """The choices no deeper than `depth` (closed under parents, as the choices are)."""
        if depth not in self._pruned:
            self._pruned[depth] = tuple(c for c in self.choices if len(c) <= depth)
        return self._pruned[depth]


def constrained_tree(choices: tuple[Choice, ...], logits: torch.Tensor, root: int, walk: DraftWalk, topk: int) -> TokenTree:
    """A constrained sequence's tree: the tokens its grammar forces after the root as a chain
    (no heads read), else the choices' tree whose depth-d choice ending in rank r takes the r-th
    most likely token of head d - 1 among those the grammar allows after the choice's parent
    path; choices beyond what the grammar allows are dropped with their subtrees.
    logits: [heads, V] of this sequence; choices in Medusa's order (parents first)."""
    if walk.stopped:  # only EOS may follow
        return TokenTree(parents=(-1,), tokens=(root,))
    if run := walk.forced(min(max(len(c) for c in choices), len(choices))):
        return TokenTree(parents=tuple(range(-1, len(run))), tokens=(root, *run))
    node_of: dict[Choice, int] = {(): 0}
    path: dict[Choice, list[int]] = {(): []}
    ranked: dict[Choice, list[int]] = {}  # parent choice -> its allowed tokens, most likely first
    parents, tokens = [-1], [root]
    for c in choices:
        parent = c[:-1]
        if parent not in node_of:
            continue
        if parent not in ranked:
            walk.to(path[parent])
            row = masked(logits[len(c) - 1], walk.allowed())
            best = row.topk(min(topk, row.shape[0]))
            ranked[parent] = best.indices[torch.isfinite(best.values)].tolist()
        if c[-1] >= len(ranked[parent]):
            continue
        node_of[c], path[c] = len(tokens), path[parent] + [ranked[parent][c[-1]]]
        parents.append(node_of[parent])
        tokens.append(path[c][-1])
    return TokenTree(parents=tuple(parents), tokens=tuple(tokens))


def medusa_choices(config: DraftConfig, num_heads: int) -> tuple[Choice, ...]:
    """config.medusa_choices (a preset name of tandem.spec.token_tree, any case, or a JSON list
    of rank lists); when empty, a chain of num_heads for shape "chain", and for "tree" the head
    folder's own tree (built best first from measured ranks by tandem train-draft) or else
    SMALL_STATIC_TREE. Choices deeper than the heads reach are dropped, a tree keeps its first
    config.tree_node_budget nodes (best_first), and the result is in Medusa's order."""
    spec = config.medusa_choices.strip()
    if not spec and config.is_tree:
        spec = read_head_choices(config.model_dir) or ""
    if not spec:
        raw = chain_choices(num_heads) if config.shape == "chain" else token_tree.SMALL_STATIC_TREE
    elif spec.startswith("["):
        try:
            raw = json.loads(spec)
        except json.JSONDecodeError as e:
            raise InvalidArgument(f"medusa_choices is not a JSON list: {e}") from None
    else:
        raw = getattr(token_tree, spec.upper(), None)
        if not isinstance(raw, tuple) or not raw or not all(isinstance(c, tuple) for c in raw):
            raise InvalidArgument(f"medusa_choices {spec!r} is neither a JSON list nor a preset of tandem.spec.token_tree")
    try:
        within = [tuple(int(r) for r in c) for c in raw if len(c) <= num_heads]
        choices = sorted_choices(within)  # the whole list must be a tree, whatever the budget keeps
    except (AssertionError, TypeError, ValueError) as e:  # a rank that is no int, a node without its parent
        raise InvalidArgument(f"medusa_choices do not form a tree: {e}") from None
    if not choices:
        raise InvalidArgument(f"medusa_choices leave no node within the {num_heads} heads")
    return sorted_choices(best_first(within, config.tree_node_budget)) if config.is_tree else choices


def best_first(choices: list[Choice], budget: int) -> list[Choice]:
    """The first `budget` nodes in listed order whose parent is kept (for a list made best first,
    its first `budget` nodes: the best tree of that size)."""
    kept: list[Choice] = []
    for c in choices:
        if len(kept) == budget:
            break
        if len(c) == 1 or c[:-1] in kept:
            kept.append(c)
    return kept

