"""Continuous batching over request trees: what the next step runs. Pure: no gRPC, no asyncio,
no tensors.

Each step, in order:
1. Decode (or verify) every running sequence with a sampled token waiting. Their pages are
   reserved first (k + 1 tokens for a speculating one): when the cache cannot hold them,
   recycled sequences are evicted, then the newest running sequences are preempted: their KV
   is dropped and they wait again at the head of the queue, to be prefilled anew with their
   prompt and output so far (nothing already streamed is lost or repeated).
2. Continue prefills in progress, within `prefill_chunk_size` tokens a step.
3. Activate waiting children of prefilled parents (fork + prefill of the last prompt token).
4. Admit waiting roots: match the prefix cache, add or fork, prefill the first chunk.
Steps 3 and 4 respect the sequence budget (`max_running`), the held-sequence limit (evicting
recycled sequences), free pages and `max_total_sequence_length`.
"""

import itertools
from collections import deque
from collections.abc import Callable

from router.draft_mirror import DraftMirror, Seat
from router.kv_state import KvState
from router.limits import EngineLimits
from router.request import Request, Sequence
from router.step_plan import Room, StepPlan
from router.overload import NeverFits, QueueFull
from tandem.ops import EntryKind, EntryResult, SequenceOp, StepEntry


class Scheduler:
    """`speculates(seq)`: would a new root speculate now (a draft service is up and the request
    allows it). `draft` mirrors the draft service's sequences (see router/draft_mirror.py)."""

    def __init__(self, limits: EngineLimits, speculates: Callable[[Sequence], bool] | None = None,
                 draft_budget: Callable[[], int] | None = None, draft_capacity: Callable[[], int] | None = None):
        self.limits = limits
        self.speculates = speculates
        # The draft's capacity: the limits count it when the draft was up at start; one that came
        # back smaller, or later, would fail whole draft calls on the sequence past it: those run
        # plainly instead, until a place frees.
        self.draft = DraftMirror(draft_capacity or (lambda: 0), speculates)
        # Draft tokens (tree nodes) a verify may carry: what the draft service says now (it may
        # come back with another shape), else the limits'.
        self.draft_budget = draft_budget or (lambda: limits.drafts_per_verify)
        self._draft_allow: dict[int, int] = {}  # this step's drafts, where fewer than the budget fit
        self._drafts_paused = False  # this step's: see StepPlan.drafts_paused
        self.kv = _kv_state(limits)
        self.waiting: deque[Sequence] = deque()  # roots, in admission order
        self.running: list[Sequence] = []  # live sequences that prefill or decode
        self.forking: list[Sequence] = []  # prefilled parents with children left to fork
        self.preempted_total = 0
        self.respeculated_total = 0  # sequences re-prefilled to speculate (_respeculate)
        self._ops: list[SequenceOp] = []
        self._seq_ids = itertools.count(1)

    def new_seq_id(self) -> int:
        return next(self._seq_ids)

    # -- requests in and out ------------------------------------------------------------------

    def enqueue(self, request: Request) -> None:
        if why := self._never_fits(request):
            raise NeverFits(why)
        waiting = len({id(s.request) for s in self.waiting})  # a tree may wait as n roots
        if waiting >= self.limits.max_waiting:
            raise QueueFull(waiting)
        roots = [request.parent] if request.parent else request.choices
        self.waiting.extend(roots)

    def _never_fits(self, request: Request) -> str:
        return self.limits.why_never_fits(len(request.spec.prompt_ids) + request.spec.max_tokens)

    def adopt(self, limits: EngineLimits) -> list[tuple[Request, str]]:
        """A restarted target's limits, once `reset` (nothing is live): the requests waiting
        that can never fit them, each with why (the caller fails them)."""
        assert not (self.running or self.forking), "adopting limits with sequences live"
        self.limits = limits
        self.kv = _kv_state(limits)
        requests = list({id(s.request): s.request for s in self.waiting}.values())
        return [(r, why) for r in requests if (why := self._never_fits(r))]

    def release(self, request: Request) -> None:
        """A cancelled request: every sequence it holds is removed with the next step."""
        request.unactivated.clear()
        for seq in [request.parent, *request.choices]:
            if seq is None:
                continue
            if seq in self.waiting:
                self.waiting.remove(seq)
            self._drop(seq)
            if seq.live:
                self._send(self.kv.remove(seq.seq_id))
                seq.live = False
            self._freed(seq)

    def finish(self, seq: Sequence) -> None:
        """A choice finished (stop or length): its sequence is recycled into the prefix cache."""
        self._drop(seq)
        if seq.live:
            self._send(self.kv.recycle(seq.seq_id))
            seq.live = False
        self._freed(seq)

    def has_pending_ops(self) -> bool:
        return bool(self._ops)

    def flush_prefix_cache(self) -> None:
        """Evicts every recycled sequence (their removal rides on the next step)."""
        while ops := self.kv.evict():
            self._send(ops)

    def reset(self) -> None:
        """The target dropped every sequence: so does the router's view of it; the draft
        drops what it held."""
        self.kv.reset()
        self._ops.clear()
        self.draft.reset()

    def stop_speculating(self, seq: Sequence) -> None:
        """The draft cannot serve this sequence any more: it decodes plainly from now on."""
        self._freed(seq)
        seq.draft.seat = Seat.OFF
        self.draft.drop(seq.seq_id)

    def draft_lost(self) -> None:
        """The draft service failed: it holds nothing any more (it is reset when back)."""
        self.draft.lost(self.running + self.forking)

    def draft_back(self) -> None:
        """The draft service is healthy again (reset, holding nothing). Sequences that lost it
        re-prefill at the next step to speculate again: the draft rebuilds a sequence's context
        only from the target's hidden states at every position, which a prefill makes."""
        self.draft.back()

    def _freed(self, seq: Sequence) -> None:
        self.draft.freed(seq, self.running + self.forking)

    def _respeculate(self) -> None:
        """Requeues the sequences the draft mirror chooses (router/draft_mirror.py); while the
        batch is too large to draft (a re-prefill would buy nothing) it waits for a later step."""
        decoding = [s for s in self.running if not s.is_parent]
        if 0 < self.limits.spec_disable_batch_size <= len(decoding):
            return
        # Appended to the left: the oldest ends up first in line.
        for seq in reversed(self.draft.respeculations(self.running + self.forking, self._draft_room)):
            self._requeue(seq)
            self.respeculated_total += 1

    def _send(self, ops: list[SequenceOp], speculates: bool = False) -> None:
        """Queues ops for the target, and their mirror for the draft."""
        self._ops += ops
        self.draft.mirror(ops, speculates)

    def _drop(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.forking:
            self.forking.remove(seq)

    # -- the plan -----------------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        entries: list[StepEntry] = []
        seqs: list[Sequence] = []
        self._draft_allow.clear()
        if self.draft.respeculation_due:
            self._respeculate()
        reserved = self._reserve_decodes()
        for seq in self.running:
            if seq.pending_token is not None:
                entries.append(StepEntry(seq.seq_id, EntryKind.DECODE, (seq.pending_token,), True))
                seqs.append(seq)
                seq.pending_token = None
        room = Room(self.limits.prefill_chunk_size, reserved, self._total_length())
        for seq in self.running:
            if room.tokens and seq.prefill_left:
                self._chunk(seq, room, entries, seqs)
        self._activate_children(room, entries, seqs)
        self._admit(room, entries, seqs)
        ops, self._ops = tuple(self._ops), []
        return StepPlan(ops, tuple(entries), tuple(seqs), self.draft.take_ops(), self._drafts_paused)

    def commit(self, plan: StepPlan) -> None:
        """The plan as sent (drafts included): its tokens take KV slots. A sequence cancelled
        while the plan was drafted is already gone here (its remove rides on the next step)."""
        for entry, seq in zip(plan.entries, plan.seqs):
            if seq.live:
                self.kv.append(entry.seq_id, len(entry.token_ids))

    def on_result(self, seq: Sequence, entry: StepEntry, result: EntryResult) -> None:
        """Mirrors what the step kept in the target's KV."""
        if not seq.live:
            return  # cancelled while the step ran: already removed
        rejected = entry.num_draft_tokens - result.num_accepted
        if rejected:
            self.kv.pop(seq.seq_id, rejected)
        # The accepted drafts (a path of a tree) follow the entry's own tokens in the KV.
        own = entry.token_ids[: len(entry.token_ids) - entry.num_draft_tokens]
        self.kv.commit(seq.seq_id, own + tuple(t.token_id for t in result.tokens[: result.num_accepted]))
        if seq.is_parent and not seq.prefill_left and seq in self.running:
            self.running.remove(seq)
            self.forking.append(seq)

    def _reserve_decodes(self) -> int:
        """Pages the decode (verify) entries of this step need; evicts and preempts until
        they fit, with the next chunks of the prefills in progress."""
        while True:
            decoding = [s for s in self.running if s.pending_token is not None]
            self._drafts_paused = 0 < self.limits.spec_disable_batch_size <= len(decoding)
            need = sum(self.kv.pages_needed(s.seq_id, 1 + self._drafts(s)) for s in decoding)
            if need + self._chunk_pages() <= self.kv.free_pages:
                return need
            if ops := self.kv.evict():
                self._send(ops)
            elif len(self.running) > 1:
                self._preempt(self._victim())
            elif parent := self._idle_parent():
                self._preempt(parent)
            else:
                return self._trim_drafts(decoding)

    def _trim_drafts(self, decoding: list[Sequence]) -> int:
        """Nothing is left to evict or preempt: speculating sequences draft fewer tokens, down
        to none (a sequence alone always fits without drafts: checked at enqueue)."""
        free, need = self.kv.free_pages - self._chunk_pages(), 0
        for s in decoding:
            n = self._drafts(s)
            while n > 0 and need + self.kv.pages_needed(s.seq_id, 1 + n) > free:
                n -= 1
            self._draft_allow[s.seq_id] = n
            need += self.kv.pages_needed(s.seq_id, 1 + n)
        return need

    def _victim(self) -> Sequence:
        """The newest running sequence (a seeded one resumes to the same output: its draws are
        keyed by position, tandem/sampling/keyed.py)."""
        return self.running[-1]

    def _idle_parent(self) -> Sequence | None:
        """A prefilled parent of a request that runs nothing now: its pages are its own."""
        busy = {id(s.request) for s in self.running}
        return next((p for p in reversed(self.forking) if id(p.request) not in busy), None)

    def _chunk_pages(self) -> int:
        """Pages the next chunks of the prefills in progress take (as `schedule` cuts them)."""
        budget, pages = self.limits.prefill_chunk_size, 0
        for seq in self.running:
            if budget and seq.prefill_left:
                size = min(seq.prefill_left, budget)
                pages += self.kv.pages_needed(seq.seq_id, size)
                budget -= size
        return pages

    def _drafts(self, seq: Sequence) -> int:
        if not seq.draft_live or self._drafts_paused:
            return 0
        return min(self.draft_budget(), self._draft_allow.get(seq.seq_id, self.draft_budget()))

    def draft_cap(self, seq: Sequence) -> int:
        """Draft tokens this step's verify of `seq` may carry: what its pages were reserved for,
        and no further than the context (its pending token comes first)."""
        cap = self._drafts(seq)
        if self.limits.max_context_length:
            cap = min(cap, self.limits.max_context_length - self.kv.length(seq.seq_id) - 1)
        return cap

    def _preempt(self, seq: Sequence) -> None:
        self._requeue(seq)
        self.preempted_total += 1

    def _requeue(self, seq: Sequence) -> None:
        """Drops its KV; it waits first in line, to resume from its prompt + output so far (a
        parent: to prefill the prompt again for the children it has left to fork)."""
        self._drop(seq)
        self._send(self.kv.remove(seq.seq_id))
        seq.live = False
        if seq.draft.live:
            seq.draft.seat = Seat.OFF
        seq.seq_id = self.new_seq_id()
        seq.num_prefilled = 0
        if not seq.is_parent:
            seq.input_ids = seq.spec.prompt_ids + tuple(seq.output_ids)
            seq.pending_token = None
        self.waiting.appendleft(seq)

    def _total_length(self) -> int:
        return sum(self.kv.length(s.seq_id) for s in self.running)

    def _chunk(self, seq: Sequence, room: Room, entries: list, seqs: list) -> None:
        size = min(seq.prefill_left, room.tokens)
        chunk = seq.input_ids[seq.num_prefilled : seq.num_prefilled + size]
        seq.num_prefilled += size
        sample = seq.prefill_left == 0 and not seq.is_parent
        entries.append(StepEntry(seq.seq_id, EntryKind.PREFILL, chunk, sample))
        seqs.append(seq)
        room.take(size, self.kv.pages_needed(seq.seq_id, size))

    def _has_slot(self, room: Room, tokens: int, pages: int | None = None, held: int = 1,
                  prompt: tuple[int, ...] = ()) -> bool:
        """A new running sequence with `tokens` to prefill now fits: the step budget, a
        sequence slot, `held` more held sequences (evicting recycled ones) and pages (likewise;
        `pages`: exactly, else a bound), with a page of headroom per running sequence."""
        if not room.tokens or len(self.running) >= self.limits.max_running:
            return False
        if room.length + tokens > self.limits.max_total_sequence_length:
            return False
        pages = self.kv.new_pages_bound(tokens) if pages is None else pages
        protected = False
        while self.kv.held + held > self.limits.max_held_sequences or not room.fits(self.kv, pages + len(self.running)):
            if prompt and not protected:  # making room must not evict the prompt's own match first
                self.kv.cache.touch_best_match(prompt)
                protected = True
            if not (ops := self.kv.evict()):
                return False
            self._send(ops)
        return True

    def _activate_children(self, room: Room, entries: list, seqs: list) -> None:
        for parent in list(self.forking):
            request = parent.request
            # A child's fork takes one page: a copy of the parent's partial last page, or a new one.
            while request.unactivated and self._has_slot(room, 1, pages=1):
                child = request.unactivated.pop(0)
                child.seq_id = self.new_seq_id()
                wants = parent.draft_live or parent.draft_denied
                self.draft.admitted(child, wants, parent.draft_live and self._draft_room())
                self._send(self.kv.fork_child(child.seq_id, parent.seq_id, child.sampler, child.draft_live,
                                              _prompt_end(child)), speculates=child.draft_live)
                child.num_prefilled = len(child.input_ids) - 1
                child.live = True
                self.running.append(child)
                self._chunk(child, room, entries, seqs)
            if not request.unactivated:  # every child holds the prompt now
                self.forking.remove(parent)
                self._send(self.kv.remove(parent.seq_id))
                self._freed(parent)
                parent.live = False

    def _admit(self, room: Room, entries: list, seqs: list) -> None:
        while self.waiting and self._admissible(self.waiting[0], room):
            seq = self.waiting.popleft()
            wants = bool(self.speculates and self.speculates(seq))
            speculate = wants and self._draft_room(2 if seq.is_parent else 1)
            self.draft.admitted(seq, wants, speculate)
            mirrors = self.draft.held.__contains__ if speculate else None
            tokens = seq.spec.prompt_ids if seq.is_parent else seq.input_ids
            ops, seq.num_prefilled = self.kv.add_root(
                seq.seq_id, tokens, seq.sampler, draft_lags=speculate, is_parent=seq.is_parent, eligible=mirrors,
                num_prompt_tokens=_prompt_end(seq))
            self._send(ops, speculates=speculate)
            if not seq.output_ids:  # a resumed sequence reported its cached tokens already
                seq.request.cached_prompt_tokens = max(seq.request.cached_prompt_tokens, seq.num_prefilled)
            seq.live = True
            self.running.append(seq)
            if seq.prefill_left:
                self._chunk(seq, room, entries, seqs)
            elif seq.is_parent:  # the whole prompt but its last token was cached
                self.running.remove(seq)
                self.forking.append(seq)

    def _requests_full(self, request: Request) -> bool:
        """max_running_requests are running and `request` is not one of them."""
        cap = self.limits.max_running_requests
        if not cap:
            return False
        running = {id(s.request) for s in (*self.running, *self.forking)}
        return id(request) not in running and len(running) >= cap

    def _draft_room(self, places: int = 1) -> bool:
        """The draft takes `places` more sequences (a parent needs 2: it and its first child)."""
        return self.draft.room(places, self.kv.recycled_ids)

    def _admissible(self, seq: Sequence, room: Room) -> bool:
        """A parent comes in only with room for a child beside it, and while no other parent
        is live: parents that cannot fork would hold slots for nothing."""
        if seq.is_parent and (self.forking or any(s.is_parent for s in self.running)):
            return False
        if self._requests_full(seq.request):
            return False
        prompt = seq.spec.prompt_ids if seq.is_parent else seq.input_ids
        return self._has_slot(room, min(seq.prefill_left, room.tokens), held=2 if seq.is_parent else 1, prompt=prompt)


def _prompt_end(seq: Sequence) -> int:
    """Where the output starts in what the model services hold of `seq`, for them to tell the
    output of a resumed sequence (its penalties, its grammar) and of a constrained one (the
    draft's grammar, which sees no prefill end); 0 otherwise: every prefilled token is prompt."""
    resumed = bool(seq.output_ids) and not seq.is_parent
    return len(seq.spec.prompt_ids) if resumed or seq.sampler.structured_output is not None else 0


def _kv_state(limits: EngineLimits) -> KvState:
    return KvState(limits.kv_pages_total, limits.kv_page_size, limits.max_held_sequences,
                   limits.prefix_cache_max_num_recycling_seqs, limits.sliding_window)
