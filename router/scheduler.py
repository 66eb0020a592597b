"""Continuous batching: what the next step runs. Pure: no gRPC, no asyncio, no tensors.

Each step decodes every running sequence that has a sampled token waiting, continues prefills
in progress, then admits waiting requests while sequence slots, KV pages and the prefill token
budget (`prefill_chunk_size`) allow. A prompt longer than the budget is prefilled in chunks over
several steps; only its last chunk samples.

Admission reserves KV pages for prompt + max_tokens, so a running request can never run out of
pages (preemption, which would admit more optimistically, comes with the prefix cache).
"""

from collections import deque
from dataclasses import dataclass

from router.request import RequestState
from tandem.errors import ResourceExhausted
from tandem.kv.pages import pages_for
from tandem.ops import AddSequence, EntryKind, RemoveSequence, SequenceOp, StepEntry


@dataclass(frozen=True, slots=True)
class SchedulerLimits:
    max_num_sequence: int
    prefill_chunk_size: int
    kv_pages_total: int
    kv_page_size: int
    max_waiting: int


@dataclass(frozen=True, slots=True)
class StepPlan:
    ops: tuple[SequenceOp, ...]
    entries: tuple[StepEntry, ...]
    # The requests with an entry, in entry order.
    requests: tuple[RequestState, ...]
    # The requests admitted by this step (their AddSequence ops are in ops).
    admitted: tuple[RequestState, ...] = ()

    @property
    def empty(self) -> bool:
        return not self.ops and not self.entries


class Scheduler:
    def __init__(self, limits: SchedulerLimits):
        self.limits = limits
        self.waiting: deque[RequestState] = deque()
        self.running: list[RequestState] = []
        self.reserved_pages = 0
        self._ops: list[SequenceOp] = []

    def pages_for(self, num_tokens: int) -> int:
        return pages_for(num_tokens, self.limits.kv_page_size)

    def enqueue(self, state: RequestState) -> None:
        if state.reserved_pages > self.limits.kv_pages_total:
            raise ResourceExhausted(
                f"request needs {state.reserved_pages} KV pages for prompt + max_tokens;"
                f" the cache holds {self.limits.kv_pages_total}"
            )
        if len(self.waiting) >= self.limits.max_waiting:
            raise ResourceExhausted(f"{len(self.waiting)} requests already waiting (max_waiting)")
        self.waiting.append(state)

    def release(self, state: RequestState) -> None:
        """Takes a finished or cancelled request out; its sequence is removed next step."""
        if state in self.running:
            self.running.remove(state)
            self.reserved_pages -= state.reserved_pages
        elif state in self.waiting:
            self.waiting.remove(state)
        if state.live:
            self._ops.append(RemoveSequence(state.seq_id))
            state.live = False

    def schedule(self) -> StepPlan:
        ops, self._ops = tuple(self._ops), []
        entries: list[StepEntry] = []
        requests: list[RequestState] = []
        for state in self.running:
            if state.pending_token is not None:
                entries.append(StepEntry(state.seq_id, EntryKind.DECODE, (state.pending_token,), True))
                requests.append(state)
                state.pending_token = None
        budget = self.limits.prefill_chunk_size
        for state in self.running:
            if budget and state.prefill_left:
                budget -= self._prefill_chunk(state, budget, entries, requests)
        new_ops, admitted = [], []
        while budget and self.waiting and self._fits(self.waiting[0]):
            state = self.waiting.popleft()
            self.running.append(state)
            self.reserved_pages += state.reserved_pages
            state.live = True
            admitted.append(state)
            new_ops.append(AddSequence(state.seq_id, state.spec.sampler))
            budget -= self._prefill_chunk(state, budget, entries, requests)
        return StepPlan(ops + tuple(new_ops), tuple(entries), tuple(requests), tuple(admitted))

    def _fits(self, state: RequestState) -> bool:
        return (
            len(self.running) < self.limits.max_num_sequence
            and self.reserved_pages + state.reserved_pages <= self.limits.kv_pages_total
        )

    @staticmethod
    def _prefill_chunk(state: RequestState, budget: int, entries: list, requests: list) -> int:
        start = state.num_prefilled
        size = min(state.prefill_left, budget)
        chunk = state.spec.prompt_ids[start : start + size]
        state.num_prefilled += size
        entries.append(StepEntry(state.seq_id, EntryKind.PREFILL, chunk, state.prefill_left == 0))
        requests.append(state)
        return size
