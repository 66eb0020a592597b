"""The router's side of speculation: asks the draft service for draft tokens, turns decode
entries into verify entries, keeps the acceptance figures, and falls back to plain decoding
when the draft service is down (no request fails for it).

The router only carries token ids and step ids; hidden states and draft probabilities go
between the target and the draft on their own stream.
"""

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from router.call_stream import CallStream
from tandem.channels import RenewableChannel
from router.drafts import fit_draft
from router.request import Sequence as RequestSeq
from router.step_plan import StepPlan
from tandem import codec
from tandem.errors import TandemError
from tandem.ops import DraftRequest, DraftSeq, EntryKind, EntryResult, SequenceOp, StepEntry
from tandem.v1 import engine_pb2, engine_pb2_grpc

log = logging.getLogger(__name__)


@dataclass(slots=True)
class SpecStats:
    verify_steps: int = 0  # verify entries (one per sequence per step)
    emitted: int = 0  # tokens those entries emitted (accepted + 1)
    draft_tokens: int = 0
    accepted_tokens: int = 0
    proposed_at: list[int] = field(default_factory=list)  # per draft position (tree depth)
    accepted_at: list[int] = field(default_factory=list)
    draft_failures: int = 0
    paused_steps: int = 0  # steps that drafted nothing for their batch size (disable_batch_size)
    # Draft calls as the router waited for them, and the draft's own time within them (which
    # includes its wait for the target's hidden states): the difference is RPC overhead.
    draft_ms: float = 0.0
    draft_compute_ms: float = 0.0

    @property
    def mean_accepted_length(self) -> float:
        return self.emitted / self.verify_steps if self.verify_steps else 1.0

    def acceptance_by_position(self) -> list[float]:
        return [a / p if p else 0.0 for a, p in zip(self.accepted_at, self.proposed_at)]

    def record(self, num_drafts: int, num_accepted: int, depth: int | None = None) -> None:
        """One verify of `num_drafts` draft tokens; `depth`: a tree's depth (a chain's is its
        length); position i counts as proposed when the drafts reach depth i + 1."""
        depth = num_drafts if depth is None else depth
        self.verify_steps += 1
        self.emitted += num_accepted + 1
        self.draft_tokens += num_drafts
        self.accepted_tokens += num_accepted
        while len(self.proposed_at) < depth:
            self.proposed_at.append(0)
            self.accepted_at.append(0)
        for i in range(depth):
            self.proposed_at[i] += 1
            self.accepted_at[i] += i < num_accepted

    def record_verified(self, entries: Iterable[StepEntry], results: Iterable[EntryResult]) -> None:
        """A step's verifies: every entry that carried drafts, whatever its stream got."""
        accepted = {r.seq_id: r.num_accepted for r in results}
        for entry in entries:
            if entry.num_draft_tokens:
                self.record(entry.num_draft_tokens, accepted[entry.seq_id], draft_depth(entry))


def draft_depth(entry: StepEntry) -> int:
    """How deep an entry's drafts go: a chain's length, a tree's deepest node."""
    if not entry.tree_parents:
        return entry.num_draft_tokens
    depths = [0]
    for parent in entry.tree_parents:
        depths.append(depths[parent] + 1)
    return max(depths)


class Speculator:
    """Which sequences the draft holds is the scheduler's to say (it sends their ops in
    StepPlan.draft_ops); this class talks to the draft service and watches its health."""

    def __init__(self, channel: RenewableChannel, k: int, timeout_s: float, vocab_size: int, probe_s: float = 2.0):
        self._channel = channel
        self._stubs()
        self.vocab_size = vocab_size  # the target's: drafts outside it are dropped
        self.k = k
        self.timeout_s = timeout_s
        self.probe_s = probe_s
        self.healthy = True
        self.stats = SpecStats()
        self.max_sequences = 0  # the draft's own limits, from its Info
        self.max_draft_tokens = 0  # tree nodes per sequence (0: k, a chain)
        self.method, self.shape = "", "chain"
        self._back = False  # healthy again since take_back() last said so
        self._ops: list[SequenceOp] = []
        self._draft_ids = itertools.count(1)
        self._probe: asyncio.Task | None = None
        self._drafts = CallStream(lambda: self.stub.Drafts(), timeout_s, "draft service", "draft_step_id")

    def _stubs(self) -> None:
        self.stub = engine_pb2_grpc.DraftEngineStub(self._channel.channel)
        self.health = health_pb2_grpc.HealthStub(self._channel.channel)

    async def connect(self, timeout_s: float) -> None:
        """Waits for the draft (it may still be loading) and drops sequences a previous router
        left; if it does not come, serve plain and keep probing."""
        try:
            await self.stub.Reset(engine_pb2.ResetRequest(), wait_for_ready=True, timeout=timeout_s)
            self._learn(await self.stub.Info(engine_pb2.InfoRequest(), timeout=timeout_s))
        except grpc.aio.AioRpcError as e:
            self._down_since_start(f"{e.code().name}: {e.details()}")

    def _learn(self, info) -> None:
        self.max_sequences = info.max_num_sequence
        self.max_draft_tokens = info.max_draft_tokens
        self.method, self.shape = info.method, info.shape or "chain"

    def _down_since_start(self, why: str) -> None:
        log.warning("draft service not reachable (%s): serving without speculation", why)
        self.healthy = False
        self._probe = asyncio.get_running_loop().create_task(self._wait_healthy())

    def wants(self, seq: RequestSeq) -> bool:
        """Would a new root speculate now."""
        return self.healthy and seq.spec.speculate

    @staticmethod
    def mark_hidden(plan: StepPlan) -> StepPlan:
        """Asks the target to stream hidden states for every entry of a speculating sequence."""
        entries = tuple(
            dataclasses.replace(e, emit_hidden=True) if s.draft_live else e for e, s in zip(plan.entries, plan.seqs)
        )
        return dataclasses.replace(plan, entries=entries)

    def finished(self, seq: RequestSeq) -> None:
        """A choice finished (the router's own drafting learns from outputs; a head does not)."""

    def take_back(self) -> bool:
        """The draft service came back (healthy, reset, holding nothing) since this was last
        asked: running sequences may re-prefill to speculate again."""
        back, self._back = self._back, False
        return back

    async def propose(self, plan: StepPlan, after_step: int, cap, trace=None) -> tuple[StepPlan, int, list[RequestSeq] | None]:
        """Drafts for each speculating decode entry, at most `cap(seq)` tokens each; returns the
        plan with verify entries, the draft step id (0 when nothing was drafted) and the
        sequences the draft could not serve (no drafts, or malformed ones), or None when the
        draft service failed (it holds nothing any more). `trace`: the step's
        router.tracing.StepTrace (its draft_call spans the Draft call)."""
        if self.healthy:
            self._ops += plan.draft_ops
        speculating = [(e, s) for e, s in zip(plan.entries, plan.seqs) if s.draft_live and e.kind is EntryKind.DECODE]
        # A cap of 0 (a paused step, pages short, the context's end) drafts nothing this step; the
        # hidden states still flow (mark_hidden) and the draft absorbs them at its next drafted step.
        wanted = [(e, s) for e, s in speculating if self._room(s) > 0 and cap(s) > 0]
        if plan.drafts_paused and speculating and self.healthy:
            self.stats.paused_steps += 1
        if not self.healthy or (not wanted and not self._ops):
            return plan, 0, []
        request = DraftRequest(
            draft_step_id=next(self._draft_ids),
            after_target_step=after_step,
            ops=tuple(self._ops),
            seqs=tuple(DraftSeq(e.seq_id, min(self.k, self._room(s), cap(s))) for e, s in wanted),
        )
        self._ops = []
        started = time.perf_counter()
        message = codec.draft_request_to_pb(request)
        try:
            with trace.draft_call() if trace else contextlib.nullcontext() as metadata:
                message.trace_context.update(metadata or ())
                response = await self._drafts.call(message)
        except TandemError as e:
            self._down(str(e))
            return plan, 0, None
        result = codec.draft_result_from_pb(response)
        self.stats.draft_ms += (time.perf_counter() - started) * 1e3
        self.stats.draft_compute_ms += result.compute_ms
        fitted = {}
        wanted = [(e, s) for e, s in wanted if s.live]  # a cancel while the draft ran: commit drops it
        for e, s in wanted:
            parents = (result.parents or {}).get(e.seq_id, ())
            draft = fit_draft(result.tokens.get(e.seq_id, ()), parents, cap(s), self.vocab_size)
            if draft is None:
                log.warning("draft service sent a malformed draft for sequence %d: dropped", e.seq_id)
            if draft and draft[0]:
                fitted[e.seq_id] = draft
        unserved = [s for e, s in wanted if e.seq_id not in fitted]  # no hidden states, or a bad draft
        entries = tuple(
            dataclasses.replace(e, token_ids=e.token_ids + fitted[e.seq_id][0],
                                num_draft_tokens=len(fitted[e.seq_id][0]), tree_parents=fitted[e.seq_id][1],
                                sampled_tree=bool(fitted[e.seq_id][1]) and e.seq_id in result.sampled_trees)
            if e.seq_id in fitted else e
            for e in plan.entries
        )
        return dataclasses.replace(plan, entries=entries), request.draft_step_id, unserved

    def close(self) -> None:
        """Ends the draft stream (the router stops)."""
        self._drafts.close()

    @staticmethod
    def _room(seq: RequestSeq) -> int:
        """Drafts worth verifying: no more than the tokens the request may still emit, minus one."""
        return seq.spec.max_tokens - len(seq.output_ids) - 1

    def _down(self, why: str) -> None:
        log.warning("draft service failed (%s): serving without speculation until it is healthy", why)
        self._drafts.close()
        self.healthy = False
        self.stats.draft_failures += 1
        self._ops = []
        self._back = False
        self._probe = asyncio.get_running_loop().create_task(self._wait_healthy())

    async def _wait_healthy(self) -> None:
        """Probes the draft's health; once SERVING again, resets it so new requests speculate."""
        while True:
            await asyncio.sleep(self.probe_s)
            if await self._channel.renew():  # a rotated certificate or CA: a channel with the new files
                self._drafts.close()
                self._stubs()
            try:
                check = await self.health.Check(health_pb2.HealthCheckRequest(), timeout=self.timeout_s)
                if check.status == health_pb2.HealthCheckResponse.SERVING:
                    await self.stub.Reset(engine_pb2.ResetRequest(), timeout=self.timeout_s)
                    self._learn(await self.stub.Info(engine_pb2.InfoRequest(), timeout=self.timeout_s))
                    self.healthy = True
                    self._back = True
                    log.info("draft service healthy again: new requests speculate, running ones once re-prefilled")
                    return
            except grpc.aio.AioRpcError:
                continue
