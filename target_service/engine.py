"""The target engine: mirrors the router's sequences, runs batched forward passes, samples.

One step = the router's sequence ops, then one forward pass over the new tokens of every entry
(prefill chunks and decode tokens packed together), then sampling for the entries that ask.
"""

import threading
import time
from collections.abc import Sequence

import torch

from tandem.attention.base import SequenceSlice
from tandem.attention.torch_backend import TorchAttention
from tandem.errors import InvalidArgument, ResourceExhausted
from tandem.kv.cache import PagedKVCache
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
from tandem.sampling.params import SamplingParams
from tandem.sampling.sampler import sample
from tandem.sampling.state import SamplingState
from target_service.config import TargetConfig


class TargetEngine:
    """Owns the base model, its paged KV cache and the sampling state of every sequence."""

    def __init__(self, config: TargetConfig):
        self.config = config
        self.device = torch.device(config.device)
        self.model = load_model(
            config.model_dir,
            dtype=parse_dtype(config.dtype),
            backend=TorchAttention(self.device),
            device=self.device,
            max_positions=config.max_context_length or None,
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
        self._samplers: dict[int, SamplingState] = {}
        self._tokens: dict[int, list[int]] = {}  # every token in each sequence's KV, in order
        self._lock = threading.Lock()
        self._steps = 0
        self._tokens_run = 0

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
        )

    def stats(self) -> EngineStats:
        return EngineStats(
            kv_pages_total=self.config.num_pages,
            kv_pages_free=self.allocator.num_free_pages,
            sequences_live=self.allocator.num_sequences,
            steps_total=self._steps,
            tokens_total=self._tokens_run,
        )

    def reset(self) -> EngineStats:
        with self._lock:
            self.allocator.clear()
            self._samplers.clear()
            self._tokens.clear()
        return self.stats()

    def step(self, request: StepRequest) -> StepResult:
        with self._lock:
            started = time.perf_counter()
            for op in request.ops:
                self._apply(op)
            results = self._run(request.entries) if request.entries else ()
            self._steps += 1
            return StepResult(
                step_id=request.step_id,
                results=results,
                kv_pages_free=self.allocator.num_free_pages,
                compute_ms=(time.perf_counter() - started) * 1e3,
            )

    # -- sequence ops -------------------------------------------------------------------------

    def _apply(self, op: SequenceOp) -> None:
        """Each op checks before it changes anything; ops apply in order."""
        if isinstance(op, AddSequence):
            state = self._new_sampler(op.sampler)
            self.allocator.add(op.seq_id)
            self._samplers[op.seq_id], self._tokens[op.seq_id] = state, []
        elif isinstance(op, ForkSequence):
            state = self._new_sampler(op.sampler)
            self.allocator.fork(op.seq_id, op.parent_id, op.position)
            prefix = self._tokens[op.parent_id][: op.position]
            state.observe_prompt(prefix)
            self._samplers[op.seq_id], self._tokens[op.seq_id] = state, prefix
        elif isinstance(op, PopTokens):
            self.allocator.pop(op.seq_id, op.count)
            del self._tokens[op.seq_id][len(self._tokens[op.seq_id]) - op.count :]
        elif isinstance(op, RemoveSequence):
            self.allocator.remove(op.seq_id)
            del self._samplers[op.seq_id], self._tokens[op.seq_id]
        else:
            raise InvalidArgument(f"unknown sequence op {op!r}")

    def _new_sampler(self, params: SamplingParams) -> SamplingState:
        """Checks the limits a new sequence must fit; no side effects."""
        if self.allocator.num_sequences >= self.config.max_num_sequence:
            raise ResourceExhausted(f"max_num_sequence ({self.config.max_num_sequence}) sequences already live")
        params.validate(self.model.config.vocab_size)
        return SamplingState(params, self.model.config.vocab_size, self.device)

    # -- the forward pass ---------------------------------------------------------------------

    def _validate(self, entries: Sequence[StepEntry]) -> None:
        seen: set[int] = set()
        pages = 0
        vocab = self.model.config.vocab_size
        for e in entries:
            if e.seq_id in seen:
                raise InvalidArgument(f"sequence {e.seq_id} appears twice in one step")
            seen.add(e.seq_id)
            if not e.token_ids:
                raise InvalidArgument(f"entry of sequence {e.seq_id} has no tokens")
            bad = [t for t in e.token_ids if not 0 <= t < vocab]
            if bad:
                raise InvalidArgument(f"token ids {bad[:5]} outside the vocabulary [0, {vocab})")
            length = self.allocator.length(e.seq_id) + len(e.token_ids)
            if length > self.max_context:
                raise InvalidArgument(
                    f"sequence {e.seq_id} would hold {length} tokens, beyond the context of {self.max_context}"
                )
            pages += self.allocator.pages_needed(e.seq_id, len(e.token_ids))
        if pages > self.allocator.num_free_pages:
            raise ResourceExhausted(f"KV cache full: step needs {pages} pages, {self.allocator.num_free_pages} free")

    def _run(self, entries: Sequence[StepEntry]) -> tuple[EntryResult, ...]:
        self._validate(entries)
        batch, last_rows = self._prepare(entries)
        hidden = self.model.forward(batch, self.cache)
        sampled = [e for e in entries if e.sample]
        results = {e.seq_id: () for e in entries}
        if sampled:
            rows = torch.tensor([last_rows[e.seq_id] for e in sampled], device=self.device)
            logits = self.model.logits(hidden[rows])
            for e, token in zip(sampled, self._sample(logits, [e.seq_id for e in sampled])):
                results[e.seq_id] = (token,)
        self._tokens_run += int(batch.input_ids.numel())
        return tuple(EntryResult(seq_id=e.seq_id, tokens=results[e.seq_id]) for e in entries)

    def _prepare(self, entries: Sequence[StepEntry]) -> tuple[ForwardBatch, dict[int, int]]:
        ids, positions, slots, slices, last_rows = [], [], [], [], {}
        for e in entries:
            cached = self.allocator.length(e.seq_id)
            new_slots, copies = self.allocator.append(e.seq_id, len(e.token_ids))
            self.cache.apply_copies(copies)
            self._tokens[e.seq_id].extend(e.token_ids)
            if e.kind is EntryKind.PREFILL:
                self._samplers[e.seq_id].observe_prompt(e.token_ids)
            ids.extend(e.token_ids)
            positions.extend(range(cached, cached + len(e.token_ids)))
            slots.extend(new_slots)
            slices.append(SequenceSlice(cached, len(e.token_ids), self.allocator.slots(e.seq_id)))
            last_rows[e.seq_id] = len(ids) - 1
        dev = self.device
        batch = ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.int64, device=dev),
            positions=torch.tensor(positions, dtype=torch.int64, device=dev),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            plan=self.model.backend.plan(slices, self.model.config.sliding_window),
        )
        return batch, last_rows

    def _sample(self, logits: torch.Tensor, seq_ids: list[int]) -> list[SampledToken]:
        states = [self._samplers[s] for s in seq_ids]
        out = sample(logits, states)
        tokens = []
        for i, state in enumerate(states):
            state.observe_output(out.token_ids[i])
            tokens.append(SampledToken(out.token_ids[i], out.logprobs[i], tuple(out.top_logprobs[i])))
        return tokens
