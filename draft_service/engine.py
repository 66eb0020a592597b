"""The draft engine: mirrors the router's sequences in its own paged KV cache, absorbs the
target's hidden states, drafts chains of k tokens or (shape "tree") EAGLE-2 token trees.

The draft's KV lags the target's by one token: draft position i holds the pair (target hidden
state at position i, token i + 1). A Draft call (1) drops the speculative positions of the last
call, (2) runs the new real pairs, whose last output proposes draft token 1, (3) feeds back its
own predicted feature with each draft token for tokens 2..k (speculative positions). A tree
grows from the same start, its expanded nodes appended as speculative positions too (see
draft_service.eagle_tree).

Fork and pop first settle the sequence they read: drop its speculative positions and absorb
its buffered real pairs, so that its KV is the target's shifted by one (equal lengths, the last
sampled token included) before it is shared or cut.
"""

import threading
import time
from dataclasses import dataclass

import torch
from opentelemetry.trace import INVALID_SPAN, Span

from draft_service.config import DraftConfig
from draft_service.eagle_tree import TreeRoot, grow_trees
from draft_service.grammars import DraftGrammars
from draft_service.proposal import propose, proposal_sampler
from draft_service.peer_client import DraftPeer, wait_for_hidden_states
from tandem.errors import InvalidArgument, NotFound
from tandem.figures import EngineFigures
from tandem.kv.batching import append_batch
from tandem.kv.cache import PagedKVCache
from tandem.models.cuda_graphs import GraphedForward
from tandem.ops import AddSequence, DraftRequest, DraftResult, EngineStats, ForkSequence, PopTokens, RemoveSequence
from tandem.peer import DraftProbs, HiddenPairs
from tandem.router_streams import RouterStreams
from tandem.sampling.sampler import PROPOSAL_WIRE_DTYPE
from tandem.sampling.state import SamplingState
from tandem.structured.drafting import point_mass
from tandem.telemetry.tracing import Tracing, ending, span_continuing


@dataclass(slots=True)
class _Seq:
    sampler: SamplingState
    speculative: int = 0  # positions appended by the last draft, dropped by the next call
    # (token, predicted feature [D]) of the last real pair that a settle absorbed in this call:
    # proposes draft token 1 when no new pairs come (a parent forked and drafted in the same call).
    settled: tuple[int, torch.Tensor] | None = None


class DraftEngine:
    def __init__(self, config: DraftConfig, head, peer: DraftPeer, tracing: Tracing | None = None):
        self.config = config
        self.head = head
        self.peer = peer
        self.tracing = tracing or Tracing.off()
        self.device = torch.device(config.device)
        mc = head.model_config
        self.cache = PagedKVCache(
            num_layers=mc.num_layers, num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim,
            num_pages=config.kv_cache_tokens // config.kv_page_size, page_size=config.kv_page_size,
            dtype=head.dtype, device=self.device,
        )
        self._head_forward = lambda batch, tokens, feats: head.forward(tokens, feats, batch, self.cache)
        # Positions the head's rope spans (the target's max_position_embeddings): a target run
        # with a longer context gets no drafts past them.
        self.max_positions = head.rope_cos.shape[0]
        if self.device.type == "cuda" and config.cuda_graphs:
            self._head_forward = GraphedForward(self._head_forward)
        self._seqs: dict[int, _Seq] = {}
        # Structured output: each constrained sequence's matcher, brought to its output per call.
        self.grammars = DraftGrammars(config.target_model_dir, head.config.vocab_size, config.constrained_drafts)
        self._reserved = 0  # pages promised to sequences earlier in this Draft call
        self._lock = threading.Lock()
        # A router's Drafts stream read through it drops every sequence at its end.
        self.router_streams = RouterStreams(self._lock, self._drop_sequences, "draft")
        self._steps = 0
        self._tokens_run = 0
        self.figures = EngineFigures()  # for /metrics and Stats

    @property
    def allocator(self):
        return self.cache.allocator

    def stats(self) -> EngineStats:
        return self.figures.fill(EngineStats(self.allocator.num_pages, self.allocator.num_free_pages, len(self._seqs), self._steps, self._tokens_run))

    def reset(self) -> EngineStats:
        with self._lock:
            self._drop_sequences()
        return self.stats()

    def _drop_sequences(self) -> None:
        self.allocator.clear()
        self._seqs.clear()
        self.grammars.clear()
        self.peer.clear()

    def draft(self, request: DraftRequest, span: Span = INVALID_SPAN) -> DraftResult:
        """`span`: the Draft call's span (events; the prefill on hidden states links to it)."""
        with self._lock:
            started = time.perf_counter()
            wait_for_hidden_states(self.peer, request.after_target_step, self.config.hidden_timeout_s)
            for seq in self._seqs.values():
                seq.settled = None
            for op in request.ops:
                self._apply(op)
            self.peer.retain(set(self._seqs))
            span.add_event("start draft")
            tokens, parents, sampled = self._draft(request, span) if request.seqs else ({}, None, frozenset())
            span.add_event("finish draft")
            self._steps += 1
            seconds = time.perf_counter() - started
            if request.seqs:  # a call of sequence ops only drafts nothing: not a step's time
                self.figures.record_step(seconds, proposed=sum(len(t) for t in tokens.values()))
            return DraftResult(request.draft_step_id, tokens, seconds * 1e3, parents, sampled)

    def _apply(self, op) -> None:
        if isinstance(op, AddSequence):
            seq = self._new_seq(op.sampler)
            self.allocator.add(op.seq_id)
            self._seqs[op.seq_id] = seq
            self.grammars.added(op.seq_id, op.sampler, op.num_prompt_tokens)
        elif isinstance(op, ForkSequence):
            self._fork(op)
        elif isinstance(op, PopTokens):
            self._pop(op)
        elif isinstance(op, RemoveSequence):
            self.allocator.remove(op.seq_id)
            del self._seqs[op.seq_id]
            self.grammars.removed(op.seq_id)
            self.peer.drop(op.seq_id)
        else:
            raise InvalidArgument(f"draft: unknown sequence op {op!r}")

    def _new_seq(self, params) -> _Seq:
        return _Seq(proposal_sampler(params, len(self._seqs), self.config, self.head.config.vocab_size, self.device))

    def _fork(self, op: ForkSequence) -> None:
        """Forks at most at the parent's settled length: a child forked beyond it (pairs the
        draft never got) finds its pairs out of reach and gets no drafts, which is lossless."""
        seq = self._new_seq(op.sampler)
        self._settle(op.parent_id)
        position = min(op.position, self.allocator.length(op.parent_id))
        self.allocator.fork(op.seq_id, op.parent_id, position)
        self._seqs[op.seq_id] = seq
        self.grammars.forked(op.seq_id, op.parent_id, position, op.sampler, op.num_prompt_tokens)

    def _pop(self, op: PopTokens) -> None:
        seq = self._settle(op.seq_id)
        count = min(op.count, self.allocator.length(op.seq_id))
        self.allocator.pop(op.seq_id, count)
        self.grammars.truncated(op.seq_id, self.allocator.length(op.seq_id))
        if count:
            seq.settled = None

    def _settle(self, seq_id: int) -> _Seq:
        """Drops the sequence's speculative positions and absorbs its buffered real pairs.
        Pairs that do not continue its KV (some were lost), or that the cache cannot hold, are
        dropped: the sequence then gets no drafts. Assumes every buffered pair precedes the op:
        the router sends a Draft call's ops before the target step that applies the same ops."""
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise NotFound(f"draft: unknown sequence {seq_id}")
        self.allocator.pop(seq_id, seq.speculative)
        seq.speculative = 0
        new, length = self.peer.take(seq_id), self.allocator.length(seq_id)
        if not any(p.start + len(p.tokens) > length for p in new):
            return seq  # nothing past its KV: what it settled last in this call is still its last pair
        seq.settled = None  # newer pairs came: drafts start from them, or not at all
        pairs = _contiguous(new, length)
        fits = pairs is not None and length + len(pairs[0]) <= self.max_positions
        if fits and self.allocator.pages_needed(seq_id, len(pairs[0])) <= self.allocator.num_free_pages:
            self.grammars.absorbed(seq_id, length, pairs[0])
            seq.settled = (pairs[0][-1], self._forward([(seq_id, pairs[0], pairs[1])])[0])
        return seq

    def _draft(self, request: DraftRequest, span: Span = INVALID_SPAN) -> tuple[dict, dict | None, frozenset]:
        """Returns (tokens, parents, sampled): seq_id -> drafts, for trees seq_id -> their
        parents, and the sequences whose tree children were sampled."""
        self._reserved = 0
        for s in request.seqs:
            if s.seq_id not in self._seqs:
                raise InvalidArgument(f"draft: unknown sequence {s.seq_id}")
            seq = self._seqs[s.seq_id]
            self.allocator.pop(s.seq_id, seq.speculative)
            seq.speculative = 0
        ready = {}  # seq_id -> (tokens, features) of the new real pairs
        k = {}  # seq_id -> the depth it drafts to
        for s in request.seqs:
            if s.num_tokens <= 0:
                continue  # its pairs stay buffered for a later call
            pairs = _contiguous(self.peer.take(s.seq_id), self.allocator.length(s.seq_id))
            if pairs is None and self._seqs[s.seq_id].settled is None:
                continue
            new = len(pairs[0]) if pairs is not None else 0
            # Its last pair and the speculative positions after it stay within the rope table.
            depth = min(s.num_tokens, self.max_positions + 1 - self.allocator.length(s.seq_id) - new)
            if depth > 0 and self._reserve(s.seq_id, new + self._speculative_bound(depth)):
                k[s.seq_id] = depth
                if pairs is not None:
                    ready[s.seq_id] = pairs
        start = {}  # seq_id -> (pending token, predicted feature [D]) of its last real pair
        for s, (pair_tokens, _) in ready.items():
            self.grammars.absorbed(s, self.allocator.length(s), pair_tokens)
        if ready:
            with ending(self._prefill_span(request.after_target_step, span, ready)):
                features = self._forward([(s, *ready[s]) for s in ready])
            start = {s: (ready[s][0][-1], f) for s, f in zip(ready, features)}
        for s in k:
            if s not in start:  # no new pairs: it starts from the pair a settle absorbed
                start[s] = self._seqs[s].settled
        tokens = {s.seq_id: () for s in request.seqs}
        if self.config.is_tree:
            parents = dict(tokens)
            trees, sampled = self._trees(start, k, request.draft_step_id)
            for s, tree in trees.items():
                tokens[s], parents[s] = tree.tokens[1:], tree.parents[1:]
            return tokens, parents, sampled
        if start:
            tokens.update(self._chains({s: f for s, (_, f) in start.items()}, k, request.draft_step_id))
        return tokens, None, frozenset()

    def _prefill_span(self, target_step: int, draft_span: Span, ready: dict) -> Span:
        """The prefill on the target's hidden states: the child of the target's span of the
        step that sent them (over the peer stream), linked to this Draft call's span."""
        if not self.tracing.enabled:
            return INVALID_SPAN  # no look-up under the peer's lock on every prefill
        span = span_continuing(self.tracing, "draft.prefill", self.peer.trace_context(target_step), draft_span)
        if span.is_recording():
            span.set_attributes({"tandem.target_step_id": target_step, "tandem.seq_ids": list(ready),
                                 "tandem.prefill_tokens": sum(len(t) for t, _ in ready.values())})
        return span

    def _speculative_bound(self, k: int) -> int:
        """Speculative positions a draft of depth k appends at most."""
        if self.config.is_tree:
            return self.config.tree_top_k * max(k - 1, 0)
        return max(k - 1, 0)

    def _reserve(self, seq_id: int, num_tokens: int) -> bool:
        """Whether the cache can take the sequence's new pairs and drafts in this call (counting
        those already admitted). A sequence that cannot gets no drafts and loses those pairs, so
        it never drafts again (the router then serves it plainly): a full draft cache turns
        speculation off for some sequences, never fails the call for all."""
        needed = self.allocator.pages_needed(seq_id, num_tokens)
        if needed > self.allocator.num_free_pages - self._reserved:
            return False
        self._reserved += needed
        return True

    def _trees(self, start: dict, k: dict[int, int], draft_step_id: int) -> tuple[dict, frozenset]:
        """start: seq_id -> (pending token, predicted feature [D]); returns (seq_id -> TokenTree,
        the sequences whose children were drawn). Their proposals go to the target, one row per
        node."""
        roots = {s: TreeRoot(t, f, self.allocator.length(s) - 1, k[s]) for s, (t, f) in start.items()}
        states = {s: self._seqs[s].sampler for s in start}
        walks = {s: w for s in start if (w := self.grammars.walk(s)) is not None}
        grown = grow_trees(roots, self.head, states, self._forward_nodes, top_k=self.config.tree_top_k,
                           node_budget=self.config.tree_node_budget, walks=walks)
        for walk in walks.values():
            walk.close()
        sampled = {s: t.probs for s, t in grown.items() if t.probs is not None}
        if sampled:
            self.peer.send_probs(DraftProbs(draft_step_id, sampled))
        return {s: t.grown.tree for s, t in grown.items()}, frozenset(sampled)

    def _chains(self, start: dict, k: dict[int, int], draft_step_id: int) -> dict[int, tuple[int, ...]]:
        """start: seq_id -> the predicted feature [D] of its last real pair. A constrained
        sequence proposes from its masked distribution; where its grammar forces tokens it
        proposes them free (no head step) and its chain ends there: the head's input after them
        comes with the target's next pairs."""
        seq_ids = list(start)
        walks = {s: w for s in seq_ids if (w := self.grammars.walk(s)) is not None}
        drafts: dict[int, list[int]] = {s: [] for s in seq_ids}
        probs: dict[int, list[torch.Tensor]] = {s: [] for s in seq_ids}
        active = [s for s in seq_ids if s not in walks or not walks[s].stopped]
        features = torch.stack([start[s] for s in active]) if active else None
        while active:
            ended = {s for s in active if self._forced(s, walks.get(s), k[s], drafts[s], probs[s])}
            rows = [i for i, s in enumerate(active) if s not in ended]
            if not rows:
                break
            active, features = [active[i] for i in rows], features[rows]
            logits = self.head.logits(features)
            for row, s in enumerate(active):
                token, q = propose(self._seqs[s].sampler, logits[row], walks.get(s))
                if token is None:  # the draft vocabulary holds no allowed token
                    ended.add(s)
                    continue
                drafts[s].append(token)
                if q is not None:
                    probs[s].append(q)
                if s in walks and (not walks[s].push(token) or walks[s].stopped):
                    ended.add(s)
            keep = [i for i, s in enumerate(active) if len(drafts[s]) < k[s] and s not in ended]
            if not keep:
                break
            active = [active[i] for i in keep]
            feeds = [(s, [drafts[s][-1]], features[i : i + 1]) for i, s in zip(keep, active)]
            for s in active:
                self._seqs[s].speculative += 1
            features = self._forward(feeds)
        for walk in walks.values():
            walk.close()
        sampled = {s: torch.stack(p) for s, p in probs.items() if p}
        if sampled:
            self.peer.send_probs(DraftProbs(draft_step_id, sampled))
        return {s: tuple(d) for s, d in drafts.items()}

    def _forced(self, seq_id: int, walk, k: int, drafts: list[int], probs: list) -> bool:
        """Appends the tokens the grammar forces at this point of the chain (a point mass each
        for a sampled request); True when there were some: the chain ends with them."""
        run = walk.forced(k - len(drafts)) if walk is not None else []
        drafts.extend(run)
        if run and not self._seqs[seq_id].sampler.params.greedy:
            probs.extend(point_mass(t, self.head.config.vocab_size, PROPOSAL_WIRE_DTYPE, self.device) for t in run)
        return bool(run)

    def _forward(self, items) -> torch.Tensor:
        """items: (seq_id, tokens, features [n, F]: the target's, F the head's feature_width, or
        its own predicted ones, [n, D]); returns the predicted feature of each
        item's last pair, [S, D]."""
        out, first_rows = self._run(items)
        last = torch.tensor([first_rows[s] + len(t) - 1 for s, t, _ in items], device=self.device)
        return out[last]

    def _forward_nodes(self, items, trees) -> list[torch.Tensor]:
        """Tree nodes as speculative positions: items as _forward's, trees seq_id -> TreeInput;
        returns each item's predicted features [n, D]."""
        for s, t, _ in items:
            self._seqs[s].speculative += len(t)
        out, first_rows = self._run(items, trees)
        return [out[first_rows[s] : first_rows[s] + len(t)] for s, t, _ in items]

    def _run(self, items, trees=None) -> tuple[torch.Tensor, dict[int, int]]:
        """Appends and runs items (seq_id, tokens, features as _forward's); returns the packed
        predicted features [T, D] and each item's first row."""
        new = [(s, t) for s, t, _ in items]
        batch, first_rows = append_batch(self.cache, self.head.backend, new, None, self.device, trees)
        feats = torch.cat([f.to(self.head.dtype) for _, _, f in items])
        out = self._head_forward(batch, batch.input_ids, feats)
        self._tokens_run += len(feats)
        return out, first_rows


def _contiguous(pairs: list[HiddenPairs], length: int):
    """The new real pairs starting at the draft's KV length, as (tokens, features); None when
    some are missing (the stream was down): that sequence gets no drafts."""
    tokens, features, position = [], [], length
    for p in pairs:
        skip = position - p.start
        if skip < 0:
            return None
        if skip < len(p.tokens):
            tokens.extend(p.tokens[skip:])
            features.append(p.hidden[skip:])
            position = p.start + len(p.tokens)
    if not tokens:
        return None
    return tokens, torch.cat(features)
