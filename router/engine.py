"""The router's engine loop: schedule -> run on the target -> postprocess, one step in flight.

Every request gets a Stream: its state, its output processor and a queue of deltas that the
Generate handler drains. The loop and the handlers share one asyncio event loop, so state is
only ever touched from one thread.
"""

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass, field

import grpc

from router.config import RouterConfig
from router.output import OutputProcessor
from router.request import GenerationSpec, RequestState
from router.scheduler import Scheduler, SchedulerLimits, StepPlan
from router.speculation import Speculator
from router.tokenizer import Tokenizer
from tandem import codec
from tandem.errors import TandemError, Unavailable
from tandem.ops import EngineInfo, StepRequest
from tandem.v1 import engine_pb2, engine_pb2_grpc

log = logging.getLogger(__name__)
RESET_RETRY_S = 1.0


@dataclass(slots=True)
class Stream:
    state: RequestState
    output: OutputProcessor
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)  # Delta | TandemError


@dataclass(slots=True)
class Counters:
    requests_total: int = 0
    prompt_tokens_total: int = 0
    completion_tokens_total: int = 0
    steps_total: int = 0
    step_errors_total: int = 0
    step_ms_total: float = 0.0
    target_compute_ms_total: float = 0.0


class RouterEngine:
    def __init__(
        self,
        config: RouterConfig,
        tokenizer: Tokenizer,
        target: engine_pb2_grpc.TargetEngineStub,
        info: EngineInfo,
        speculator: Speculator | None = None,
        first_step_id: int = 1,
    ):
        self.config = config
        self.tokenizer = tokenizer
        self.target = target
        self.info = info
        self.scheduler = Scheduler(
            SchedulerLimits(
                max_num_sequence=min(config.max_num_sequence or info.max_num_sequence, info.max_num_sequence),
                prefill_chunk_size=config.prefill_chunk_size,
                kv_pages_total=info.kv_pages_total,
                kv_page_size=info.kv_page_size,
                max_waiting=config.max_waiting,
            )
        )
        self.counters = Counters()
        self.speculator = speculator
        self._last_step = 0  # the last target step that completed
        self.kv_pages_free = info.kv_pages_total
        self._streams: dict[int, Stream] = {}
        self._seq_ids = itertools.count(1)
        self._step_ids = itertools.count(first_step_id)
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def submit(self, spec: GenerationSpec) -> Stream:
        # Drafts are capped by the tokens a request may still emit, so a verify step never holds
        # more than prompt + max_tokens - 1 tokens of KV: no spare pages are needed.
        tokens = len(spec.prompt_ids) + spec.max_tokens
        state = RequestState(spec=spec, seq_id=next(self._seq_ids), reserved_pages=self.scheduler.pages_for(tokens))
        self.scheduler.enqueue(state)  # raises ResourceExhausted before anything is kept
        stream = Stream(state, OutputProcessor(state, self.tokenizer.hf))
        self._streams[state.seq_id] = stream
        self.counters.requests_total += 1
        self.counters.prompt_tokens_total += len(spec.prompt_ids)
        self._wake.set()
        return stream

    def cancel(self, stream: Stream) -> None:
        """The client went away: free its sequence at the next step."""
        if not stream.state.finished:
            stream.output.cancel()
        self._finish(stream)

    def _finish(self, stream: Stream) -> None:
        self.scheduler.release(stream.state)
        if self.speculator:
            self.speculator.release(stream.state)
        self._streams.pop(stream.state.seq_id, None)
        self.counters.completion_tokens_total += len(stream.state.output_ids)
        self._wake.set()

    async def _loop(self) -> None:
        while True:
            plan = self.scheduler.schedule()
            if plan.empty:
                self._wake.clear()
                await self._wake.wait()
                continue
            draft_step = 0
            if self.speculator:
                plan, draft_step = await self._speculate(plan)
            try:
                result = await self._step(plan, draft_step)
            except TandemError as e:
                self._fail_running(e)
                await self._reset_target()  # before any new sequence reaches the target
                continue
            self._postprocess(plan, result)

    async def _speculate(self, plan: StepPlan) -> tuple[StepPlan, int]:
        for state in plan.admitted:
            self.speculator.admit(state)
        plan, draft_step = await self.speculator.propose(plan, self._last_step, self.scheduler.running)
        return self.speculator.mark_hidden(plan), draft_step

    async def _step(self, plan: StepPlan, draft_step: int = 0):
        request = StepRequest(step_id=next(self._step_ids), ops=plan.ops, entries=plan.entries, draft_step_id=draft_step)
        started = time.perf_counter()
        try:
            response = await self.target.Step(codec.step_request_to_pb(request), timeout=self.config.step_timeout_s)
        except grpc.aio.AioRpcError as e:
            raise _as_error(e) from e
        result = codec.step_result_from_pb(response)
        self.counters.steps_total += 1
        self.counters.step_ms_total += (time.perf_counter() - started) * 1e3
        self.counters.target_compute_ms_total += result.compute_ms
        self._last_step = request.step_id
        return result

    def _postprocess(self, plan: StepPlan, result) -> None:
        self.kv_pages_free = result.kv_pages_free
        by_seq = {r.seq_id: r for r in result.results}
        for entry, state in zip(plan.entries, plan.requests):
            accepted = by_seq[state.seq_id].num_accepted
            if entry.num_draft_tokens:
                self.speculator.stats.record(entry.num_draft_tokens, accepted)
            stream = self._streams.get(state.seq_id)
            if stream is None or state.finished:
                continue  # cancelled while the step ran
            tokens = by_seq[state.seq_id].tokens
            if not tokens:
                continue  # a prefill chunk with prompt left
            delta = stream.output.process(tokens)
            # Usage counts what the client got: drafts after a stop are not accepted tokens.
            state.draft_tokens += entry.num_draft_tokens
            state.accepted_draft_tokens += min(accepted, len(delta.tokens))
            stream.queue.put_nowait(delta)
            if state.finished:
                self._finish(stream)

    def _fail_running(self, error: TandemError) -> None:
        """A failed step leaves the target's state unknown: fail every running request and
        start the target afresh; waiting requests are unaffected."""
        log.error("step failed: %s; failing %d running requests", error, len(self.scheduler.running))
        self.counters.step_errors_total += 1
        for state in list(self.scheduler.running):
            stream = self._streams.get(state.seq_id)
            state.live = False  # Reset drops it; no remove op needed
            if self.speculator:
                self.speculator.release(state)
            if stream:
                stream.queue.put_nowait(error)
                state.finish_reason = state.finish_reason or stream.output.cancel().finish_reason
                self._finish(stream)

    async def _reset_target(self) -> None:
        """Until the target has dropped every sequence, nothing new is scheduled: a target that
        stays down fails the requests that wait (UNAVAILABLE) rather than leaking them."""
        while True:
            try:
                await self.target.Reset(engine_pb2.ResetRequest(), timeout=self.config.step_timeout_s)
                return
            except grpc.aio.AioRpcError as e:
                log.warning("target reset failed: %s; retrying", e.details())
                error = Unavailable(f"target service unavailable: {e.details()}")
                for state in list(self.scheduler.waiting):
                    stream = self._streams.get(state.seq_id)
                    if stream:
                        stream.queue.put_nowait(error)
                        stream.output.cancel()
                        self._finish(stream)
                await asyncio.sleep(RESET_RETRY_S)


def _as_error(e: grpc.aio.AioRpcError) -> TandemError:
    code = e.code()
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
        return Unavailable(f"target service unavailable: {e.details()}")
    return TandemError(f"target service failed a step: {code.name}: {e.details()}")

