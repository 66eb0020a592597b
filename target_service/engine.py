"""The target engine: mirrors the router's sequences, runs batched forward passes, samples.

One step = the router's sequence ops, then one forward pass over the new tokens of every entry
(prefill chunks and decode tokens packed together), then sampling for the entries that ask.
"""

import logging
import threading
import time
import uuid
from collections.abc import Sequence

import torch
from opentelemetry.trace import INVALID_SPAN, Span

from tandem.attention.torch_backend import TorchAttention
from tandem.errors import InvalidArgument, ResourceExhausted
from tandem.figures import EngineFigures
from tandem.kv.batching import append_batch
from tandem.kv.cache import PagedKVCache
from tandem.models.cuda_graphs import GraphedForward
from tandem.models.llama import ForwardBatch
from tandem.models.loader import load_model, parse_dtype
from tandem.ops import (
    AddSequence,
    EngineInfo,
    EngineStats,
    EntryKind,
    EntryResult,
    ForkSequence,
    PopTokens,
    RemoveSequence,
    SampledToken,
    SequenceOp,
    StepEntry,
    StepRequest,
    StepResult,
)
from tandem.router_streams import RouterStreams
from tandem.sampling.params import SamplingParams
from tandem.sampling.sampler import received_proposal, sample
from tandem.peer import HiddenPairs, HiddenStep, TargetPeer
from tandem.sampling.state import SamplingState
from tandem.sampling.tree_verify import fits_sampled_tree, verify_tree
from tandem.sampling.verify import verify_chain
from tandem.spec.token_tree import TokenTree
from tandem.telemetry.tracing import carrier, step_phases
from target_service.config import TargetConfig
from target_service.entries import chain_proposal, check_entries, rows_of, tree_input, verifies_with_q
from target_service.grammars import TargetGrammars, allowed_rows

log = logging.getLogger(__name__)


class TargetEngine:
    """Owns the base model, its paged KV cache and the sampling state of every sequence."""

    def __init__(self, config: TargetConfig):
        self.config = config
        self.instance_id = uuid.uuid4().hex  # a restarted target is another (EngineInfo.instance_id)
        self.device = torch.device(config.device)
        self.model = load_model(
            config.model_dir,
            dtype=parse_dtype(config.dtype),
            backend=TorchAttention(self.device),
            device=self.device,
            max_positions=config.max_context_length or None,
            kernels=config.cpu_kernels,
        )
        mc = self.model.config
        self.max_context = config.max_context_length or mc.max_position_embeddings
        self.cache = PagedKVCache(
            num_layers=mc.num_layers,
            num_kv_heads=mc.num_kv_heads,
            head_dim=mc.head_dim,
            num_pages=config.num_pages,
            page_size=config.kv_page_size,
            dtype=self.model.dtype,
            device=self.device,
        )
        self._capture: tuple[int, ...] = ()  # the peer's feature layers the forward returns too
        self._model_forward = self._forward_capturing(())
        self.peer = TargetPeer()
        self._samplers: dict[int, SamplingState] = {}
        self._carry: dict[int, torch.Tensor] = {}  # hidden of a chunk's last position, awaiting its next token
        self._kept_nodes: dict[int, tuple[int, ...]] = {}  # this step's accepted path of a verify
        self._tokens: dict[int, list[int]] = {}  # every token in each sequence's KV, in order
        self.grammars = TargetGrammars(config.model_dir, mc.vocab_size)  # structured output's matchers
        self._lock = threading.Lock()
        # A router's Steps stream read through it drops every sequence at its end.
        self.router_streams = RouterStreams(self._lock, self._drop_sequences, "target")
        self.last_step_id = 0
        self._steps = 0
        self._tokens_run = 0
        self.figures = EngineFigures()  # for /metrics and Stats

    def _forward_capturing(self, layers: tuple[int, ...]):
        """The forward pass returning the final-norm hidden states and the inputs of `layers`
        (tandem.models.llama.LlamaModel.forward); graphed on a GPU, one set of graphs per layers."""
        forward = lambda batch, embeds: self.model.forward(batch, self.cache, embeds, layers)  # noqa: E731
        return GraphedForward(forward) if self.device.type == "cuda" and self.config.cuda_graphs else forward

    def _follow_peer(self) -> None:
        """Streams what the connected draft reads: its feature layers, or the final-norm hidden
        state. A change drops the carries, which hold the old features."""
        layers = self.peer.feature_layers
        if layers != self._capture:
            self._capture, self._model_forward = layers, self._forward_capturing(layers)
            self._carry.clear()

    @property
    def allocator(self):
        return self.cache.allocator

    def info(self) -> EngineInfo:
        mc = self.model.config
        return EngineInfo(
            model=self.config.model_dir.name,
            architecture=mc.architecture,
            vocab_size=mc.vocab_size,
            max_context_length=self.max_context,
            kv_page_size=self.config.kv_page_size,
            kv_pages_total=self.config.num_pages,
            max_num_sequence=self.config.max_num_sequence,
            dtype=self.config.dtype,
            hidden_size=mc.hidden_size,
            sliding_window=mc.sliding_window or 0,
            instance_id=self.instance_id,
        )

    def stats(self) -> EngineStats:
        return self.figures.fill(EngineStats(
            kv_pages_total=self.config.num_pages,
            kv_pages_free=self.allocator.num_free_pages,
            sequences_live=self.allocator.num_sequences,
            steps_total=self._steps,
            tokens_total=self._tokens_run,
            last_step_id=self.last_step_id,
        ))

    def reset(self) -> EngineStats:
        with self._lock:
            self._drop_sequences()
        return self.stats()

    def _drop_sequences(self) -> None:
        self.allocator.clear()
        self._samplers.clear()
        self._tokens.clear()
        self._carry.clear()
        self.grammars.clear()
        self.peer.clear_probs()  # a fresh router numbers its draft steps from 1 again

    def step(self, request: StepRequest, span: Span = INVALID_SPAN) -> StepResult:
        """`span`: the step's span (events are added to it; the draft's work on this step's
        hidden states becomes its child)."""
        with self._lock:
            started = time.perf_counter()
            for op in request.ops:
                self._apply(op)
            trace_context = tuple(carrier(span).items())
            results = self._run(request, span, trace_context) if request.entries else ()
            if not request.entries:
                self.peer.send(HiddenStep(request.step_id, (), trace_context))
            self._steps += 1
            self.last_step_id = request.step_id
            seconds = time.perf_counter() - started
            if request.entries:  # a step of sequence ops only runs no model: not a step's time
                self.figures.record_step(seconds, request.entries)
            return StepResult(
                step_id=request.step_id,
                results=results,
                kv_pages_free=self.allocator.num_free_pages,
                compute_ms=seconds * 1e3,
            )

    # -- sequence ops -------------------------------------------------------------------------

    def _apply(self, op: SequenceOp) -> None:
        """Each op checks before it changes anything; ops apply in order."""
        if isinstance(op, AddSequence):
            state = self._new_sampler(op.sampler, op.num_prompt_tokens)
            self.allocator.add(op.seq_id)
            self._samplers[op.seq_id], self._tokens[op.seq_id] = state, []
            self.grammars.added(op.seq_id, op.sampler, op.num_prompt_tokens)
        elif isinstance(op, ForkSequence):
            self._fork(op)
        elif isinstance(op, PopTokens):
            self.allocator.pop(op.seq_id, op.count)
            del self._tokens[op.seq_id][len(self._tokens[op.seq_id]) - op.count :]
            self._carry.pop(op.seq_id, None)  # it would pair with the wrong next token
        elif isinstance(op, RemoveSequence):
            self.allocator.remove(op.seq_id)
            del self._samplers[op.seq_id], self._tokens[op.seq_id]
            self._carry.pop(op.seq_id, None)
            self.grammars.removed(op.seq_id)
        else:
            raise InvalidArgument(f"unknown sequence op {op!r}")

    def _fork(self, op: ForkSequence) -> None:
        """The child shares the parent's first `position` tokens. Forked at the parent's full
        length, it also inherits the parent's carry: an n > 1 child whose parent prefilled the
        prompt without its last token pairs the parent's last hidden state with that token."""
        state = self._new_sampler(op.sampler, op.num_prompt_tokens)
        self.allocator.fork(op.seq_id, op.parent_id, op.position)
        prefix = self._tokens[op.parent_id][: op.position]
        state.observe_prefill(0, prefix)
        self._samplers[op.seq_id], self._tokens[op.seq_id] = state, prefix
        self.grammars.added(op.seq_id, op.sampler, op.num_prompt_tokens, len(prefix))
        carry = self._carry.get(op.parent_id)
        if carry is not None and op.position == self.allocator.length(op.parent_id):
            self._carry[op.seq_id] = carry.clone()

    def _new_sampler(self, params: SamplingParams, num_prompt_tokens: int = 0) -> SamplingState:
        """Checks the limits a new sequence must fit; no side effects."""
        if self.allocator.num_sequences >= self.config.max_num_sequence:
            raise ResourceExhausted(f"max_num_sequence ({self.config.max_num_sequence}) sequences already live")
        params.validate(self.model.config.vocab_size)
        self.grammars.check(params)
        return SamplingState(params, self.model.config.vocab_size, self.device, num_prompt_tokens)

    # -- the forward pass ---------------------------------------------------------------------

    def _run(self, request: StepRequest, span: Span, trace_context) -> tuple[EntryResult, ...]:
        entries = request.entries
        self._kept_nodes.clear()
        check_entries(entries, self.allocator, self.model.config.vocab_size, self.max_context)
        span.add_event("start embedding")
        batch, first_rows = self._prepare(entries)
        embeds = self.model.embed(batch.input_ids)
        span.add_event("finish embedding")
        phases = step_phases(entries)  # MLC's trace points: one forward pass serves them all
        for phase in phases:
            span.add_event(f"start {phase}")
        self._follow_peer()
        scored = [e for e in entries if e.sample]
        pending = self.grammars.start(scored, self._tokens)  # mask rows, while the forward runs
        try:
            hidden = self._model_forward(batch, embeds)
        finally:
            masks = pending.result() if pending is not None else {}
        features = hidden  # what the draft reads
        if self._capture:
            d = self.model.config.hidden_size
            hidden, features = hidden[:, :d], hidden[:, d:]
        self._tokens_run += int(batch.input_ids.numel())
        rows = [first_rows[e.seq_id] + len(e.token_ids) - 1 - i for e in scored for i in range(e.num_draft_tokens, -1, -1)]
        logits = self.model.logits(hidden[torch.tensor(rows, device=self.device)]) if rows else None
        starts = rows_of(scored)
        results = {}
        plain = [e for e in scored if e.num_draft_tokens == 0]
        if plain:
            plain_rows = torch.tensor([starts[e.seq_id] for e in plain], device=self.device)
            sampled = self._sample(logits[plain_rows], [e.seq_id for e in plain], masks)
            results.update({e.seq_id: EntryResult(e.seq_id, (t,)) for e, t in zip(plain, sampled)})
        drafted = [e for e in scored if e.num_draft_tokens]
        results.update(self._verify(drafted, logits, starts, request.draft_step_id, masks))
        for phase in phases:
            span.add_event(f"finish {phase}")
        for e in entries:
            results.setdefault(e.seq_id, EntryResult(e.seq_id, ()))
        self._emit_hidden(request.step_id, entries, features, first_rows, results, trace_context)
        return tuple(results[e.seq_id] for e in entries)

    def _verify(self, entries, logits, row_starts: dict[int, int], draft_step_id: int, masks) -> dict[int, EntryResult]:
        """Accepts a prefix of each entry's drafts; keeps only the accepted tokens' KV. masks:
        the grammar's rows of constrained entries."""
        if not entries:
            return {}
        # Draft step 0: drafts made without a draft service (the router's lookup), point masses.
        need_probs = draft_step_id > 0 and any(verifies_with_q(self._samplers[e.seq_id].params) and (e.sampled_tree or not e.tree_parents)
                         for e in entries)
        probs = (self.peer.take_probs(draft_step_id, self.config.draft_probs_timeout_s) or {}) if need_probs else {}
        probs = {s: received_proposal(q) for s, q in probs.items()}  # fp16 on the wire
        out = {}
        for e in entries:
            k = e.num_draft_tokens
            rows = logits[row_starts[e.seq_id] : row_starts[e.seq_id] + k + 1]
            if e.tree_parents:
                q = probs.get(e.seq_id) if e.sampled_tree else None
                result = self._verify_tree(e, rows, q[: k + 1] if q is not None and q.shape[0] > k else None,
                                           masks.get(e.seq_id))
            else:
                drafts = e.token_ids[len(e.token_ids) - k :]
                q = chain_proposal(probs.get(e.seq_id), drafts, rows.shape[1], e.seq_id)
                first = len(self._tokens[e.seq_id]) - k  # the index row 0 scores
                result = verify_chain(rows, drafts, q, self._samplers[e.seq_id], first, masks.get(e.seq_id))
                self._kept_nodes[e.seq_id] = tuple(range(result.num_accepted + 1))
                rejected = k - result.num_accepted
                if rejected:
                    self.allocator.pop(e.seq_id, rejected)
                    del self._tokens[e.seq_id][-rejected:]
            tokens = tuple(SampledToken(t.token_id, t.logprob, t.top) for t in result.tokens)
            self.grammars.emitted(e.seq_id, [t.token_id for t in tokens])
            out[e.seq_id] = EntryResult(e.seq_id, tokens, result.num_accepted)
        return out

    def _verify_tree(self, e: StepEntry, rows: torch.Tensor, q: torch.Tensor | None, allowed=None):
        """The entry's last k + 1 tokens are a token tree (node 0 = the last sampled token).
        q: [k + 1, V], row i the distribution node i's children were drawn from without
        replacement (a sampled tree); None: they count as chosen deterministically, which is
        lossless for any children the draft chose. Only the accepted path's KV stays."""
        k = e.num_draft_tokens
        tree = TokenTree((-1, *e.tree_parents), e.token_ids[len(e.token_ids) - k - 1 :])
        if q is not None and (q.shape[1] != rows.shape[1] or not fits_sampled_tree(q, tree)):
            log.warning("draft probabilities of sequence %d do not fit its tree: verified as top-k", e.seq_id)
            q = None
        result = verify_tree(rows, tree, q, self._samplers[e.seq_id], len(self._tokens[e.seq_id]) - k, allowed)
        kept = (0, *result.accepted_nodes)
        start = self.allocator.length(e.seq_id) - (k + 1)
        self.cache.keep_path(e.seq_id, start, kept)
        del self._tokens[e.seq_id][start:]
        self._tokens[e.seq_id].extend(tree.tokens[n] for n in kept)
        self._kept_nodes[e.seq_id] = kept
        return result

    def _emit_hidden(self, step_id: int, entries, hidden, first_rows, results, trace_context=()) -> None:
        """Streams (hidden state, next token) pairs of every accepted position to the draft;
        `hidden` [T, F]: what the draft reads of each packed row (the peer's feature layers).
        A chunk's last position waits for its next token (the next chunk's first) in a carry."""
        stale = self.peer.feature_layers != self._capture  # a peer reading other layers attached mid-step
        if not self.peer.connected or stale:
            for e in entries:  # their pairs are lost; a stale carry would pair wrongly later
                self._carry.pop(e.seq_id, None)
            if stale:
                self.peer.send(HiddenStep(step_id, (), trace_context))  # the step is past, its pairs lost
            return
        pairs = []
        for e in entries:
            if not e.emit_hidden:
                continue
            emitted = results[e.seq_id].tokens
            kept = self._kept_rows(e)
            start = self.allocator.length(e.seq_id) - len(kept)
            rows = hidden[torch.tensor([first_rows[e.seq_id] + r for r in kept], device=self.device)]
            kept_tokens = [e.token_ids[r] for r in kept]
            tokens = kept_tokens[1:] + [t.token_id for t in emitted[-1:]]
            carry = self._carry.pop(e.seq_id, None)
            if carry is not None:
                rows, start = torch.cat((carry[None], rows)), start - 1
                tokens.insert(0, e.token_ids[0])
            if not emitted:
                self._carry[e.seq_id] = rows[-1].clone()
                rows = rows[:-1]
            if tokens:
                pairs.append(HiddenPairs(e.seq_id, start, tuple(tokens), rows.clone()))
        self.peer.send(HiddenStep(step_id, tuple(pairs), trace_context))

    def _kept_rows(self, e: StepEntry) -> list[int]:
        """The entry's rows whose tokens stayed in the KV: all but the drafts, then the
        accepted path (node 0 is the first token of a decode entry)."""
        base = len(e.token_ids) - e.num_draft_tokens - 1
        nodes = self._kept_nodes.pop(e.seq_id, (0,))
        return list(range(base)) + [base + n for n in nodes]

    def _prepare(self, entries: Sequence[StepEntry]) -> tuple[ForwardBatch, dict[int, int]]:
        """Appends every entry's tokens; returns the batch and each entry's first packed row."""
        for e in entries:
            if e.kind is EntryKind.PREFILL:
                self._samplers[e.seq_id].observe_prefill(len(self._tokens[e.seq_id]), e.token_ids)
            self._tokens[e.seq_id].extend(e.token_ids)
            if e.kind is EntryKind.PREFILL:
                self.grammars.prefilled(e.seq_id, len(self._tokens[e.seq_id]))
        items = [(e.seq_id, e.token_ids) for e in entries]
        trees = {e.seq_id: t for e in entries if (t := tree_input(e)) is not None}
        return append_batch(self.cache, self.model.backend, items, self.model.config.sliding_window, self.device, trees)

    def _sample(self, logits: torch.Tensor, seq_ids: list[int], masks) -> list[SampledToken]:
        states = [self._samplers[s] for s in seq_ids]
        allowed = allowed_rows(masks, seq_ids, logits.shape[1])
        out = sample(logits, states, [len(self._tokens[s]) for s in seq_ids], allowed)  # each token's index
        tokens = []
        for i, state in enumerate(states):
            state.observe_output(out.token_ids[i])
            self.grammars.emitted(seq_ids[i], out.token_ids[i:i + 1])
            tokens.append(SampledToken(out.token_ids[i], out.logprobs[i], tuple(out.top_logprobs[i])))
        return tokens
