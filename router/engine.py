"""The router's engine loop: schedule -> draft -> run on the target -> postprocess, one step
in flight.

Every request is a tree of sequences (router.request) with a queue of deltas that the Generate
handler drains. The loop and the handlers share one asyncio event loop, so state is only ever
touched from one thread.
"""

import asyncio
import itertools
import logging
import time
from collections.abc import Awaitable, Callable

from opentelemetry.trace import INVALID_SPAN, Span

from router.config import RouterConfig
from router.limits import resolve_limits
from router.output import OutputProcessor
from router.postprocess import postprocess
from router.overload import DrainRate, NeverFits, QueueFull
from router.figures import RouterFigures
from router.request import GenerationSpec, Request, new_request
from router.scheduler import Scheduler
from router.step_plan import StepPlan
from router.speculation import Speculator
from router.target_link import RESET_RETRY_S, TargetLink
from router.tokenizer import Tokenizer
from router.tracing import NO_STEP, RouterTracing
from tandem.errors import FailedPrecondition, InvalidArgument, TandemError, Unavailable
from tandem.ops import EngineInfo, StepRequest
from tandem.telemetry.tracing import Tracing

log = logging.getLogger(__name__)


class Wake(asyncio.Event):
    """The engine loop's wake-up, made on the event loop; `ring` is safe from any thread (a
    gRPC callback)."""

    def __init__(self):
        super().__init__()
        self._running_loop = asyncio.get_running_loop()

    def ring(self) -> None:
        self._running_loop.call_soon_threadsafe(self.set)


class RouterEngine:
    def __init__(
        self,
        config: RouterConfig,
        tokenizer: Tokenizer,
        target: TargetLink,
        info: EngineInfo,
        speculator: Speculator | None = None,
        first_step_id: int = 1,
        draft_max_num_sequence: int | None = None,
        tracing: Tracing | None = None,
        wake: Wake | None = None,
        on_serving: Callable[[bool], Awaitable[None]] | None = None,
    ):
        """`wake`: the loop's wake-up, which the target link rings when its step stream ends
        (made before both: see router/server.py). `on_serving(serving)`: reports the router's
        health (gRPC health, /health)."""
        self.config = config
        self.tracing = RouterTracing(tracing or Tracing.off(), info.model)
        self.tokenizer = tokenizer
        self.target = target
        self.info = info
        self._draft_limits = (draft_max_num_sequence if speculator else None, speculator.max_draft_tokens if speculator else 0)
        self.limits = resolve_limits(config, info, *self._draft_limits)
        self._wrong_target = ""  # why the target, restarted, cannot be served (_adopt)
        self.serving = True  # the target is reachable and serves the router's model
        self.on_serving = on_serving
        self.speculator = speculator
        budget = (lambda: max(self.limits.spec_draft_length, speculator.max_draft_tokens)) if speculator else None
        self.scheduler = Scheduler(self.limits, speculator.wants if speculator else None, budget,
                                   (lambda: speculator.max_sequences) if speculator else None)
        self.drain = DrainRate()  # requests finishing lately: a full queue's retry pushback
        self.figures = RouterFigures()  # counts, latencies and outcomes, for /metrics and Stats
        self._last_step = 0  # the last target step that completed
        self.kv_pages_free = info.kv_pages_total
        self._requests: list[Request] = []
        self._closing = False  # cancel_all ran: the router is going away
        self._step_ids = itertools.count(first_step_id)
        # A step stream that ends while idle rings it: a target gone or restarted is found then,
        # not at the next request, and the router's health follows it.
        self._wake = wake or Wake()
        self._opened = -RESET_RETRY_S  # when _reopen last opened the step stream (time.monotonic())
        self._stream_ended = False  # a step stream was opened (and reopening means it ended)
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self.target.close()
        if self.speculator:
            self.speculator.close()

    def submit(self, spec: GenerationSpec, span: Span = INVALID_SPAN, arrived: float | None = None) -> Request:
        """`span`: the request's span (router.tracing), ended by the caller. `arrived`: when the
        request reached the router (time.monotonic(), before tokenizing; default now), from
        which its time to first token and duration count."""
        if self._closing:  # it was tokenized while the router began to shut down
            raise Unavailable("the router is shutting down")
        request = new_request(spec, self.scheduler.new_seq_id)
        for seq in request.choices:  # before enqueue: a sequence queued without one never streams
            seq.output = OutputProcessor(seq, self.tokenizer.hf)
        try:
            self.scheduler.enqueue(request)  # raises ResourceExhausted before anything is kept
        except QueueFull as e:
            self.figures.requests_refused_total += 1
            e.retry_after_ms = self.drain.retry_after_ms(e.waiting)  # when the queue ahead drains
            raise
        self.tracing.added(request, span)
        self._requests.append(request)
        self.figures.on_submit(request, arrived)
        self._wake.set()
        return request

    def cancel(self, request: Request) -> None:
        """The client went away: its sequences are removed with the next step."""
        for seq in request.choices:
            if not seq.finished:
                seq.output.cancel()
        self.scheduler.release(request)
        self._retire(request)

    def begin_drain(self) -> None:
        """The router is going away (SIGTERM): requests running or waiting go on, new ones are
        refused UNAVAILABLE, so a client retries them on another replica."""
        self._closing = True

    @property
    def draining(self) -> bool:
        """The router is going away: new requests are refused (UNAVAILABLE)."""
        return self._closing

    @property
    def live_requests(self) -> int:
        return len(self._requests)

    async def drained(self, timeout_s: float) -> bool:
        """Waits until no request is live, at most `timeout_s`; True if none is."""
        deadline = time.monotonic() + timeout_s
        while self._requests and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return not self._requests

    def cancel_all(self) -> None:
        """The router shuts down: every request still live ends now, each unfinished choice with
        a "cancelled" delta, and its stream with the usage so far (the client sees an answer,
        not a dropped call). Requests submitted after it are refused (UNAVAILABLE)."""
        self._closing = True
        for request in list(self._requests):
            for seq in request.choices:
                if not seq.finished and seq.output is not None:
                    request.queue.put_nowait(seq.output.cancel())
            self.scheduler.release(request)
            self._retire(request)

    def flush_prefix_cache(self) -> None:
        """Evicts every recycled sequence (tests use it to check that nothing else is held)."""
        self.scheduler.flush_prefix_cache()
        self._wake.set()

    def _retire(self, request: Request) -> None:
        if request in self._requests:
            self._requests.remove(request)
            reason = self.figures.on_finished(request)
            self.tracing.finished(request, reason)
            self.drain.record()
        self._wake.set()

    async def _loop(self) -> None:
        while True:
            try:
                await self._iterate()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # a bug must not hang every request: fail those running
                log.exception("router engine step failed")
                self._fail_running(TandemError(f"router internal error: {e!r}"))
                await self._reset_target()

    async def _iterate(self) -> None:
        """One step: schedule -> draft -> target -> postprocess (or wait for work)."""
        if not self.target.stream_open:  # first step, or the stream ended: the target may be gone
            await self._reopen()
        if self._wrong_target:  # not even an empty step for the draft's removals
            for request in list(self._requests):
                self._fail(request, FailedPrecondition(self._wrong_target))
            await self._idle()  # until the stream ends: the target restarts, maybe with our model
            return
        if self.speculator and self.speculator.take_back():
            self.scheduler.draft_back()
        plan = self.scheduler.schedule()
        if plan.empty and not plan.draft_ops:
            await self._idle()
            return
        with self.tracing.step(plan) as trace:
            await self._run_step(plan, trace)

    async def _idle(self) -> None:
        self._wake.clear()
        await self._wake.wait()

    async def _reopen(self) -> None:
        """Checks the target, then opens the step stream before any step: its end wakes the
        loop even while idle (Wake.ring), so a target gone or restarted is found at once. A
        stream that ended took the router's sequences with it (the target drops them, as it
        would for a router that died): the target is reset and the router's view with it."""
        await asyncio.sleep(self._opened + RESET_RETRY_S - time.monotonic())  # a stream that ends at once
        if self._stream_ended:
            self._lose_target(Unavailable("the step stream to the target ended"))
            await self._reset_target()
        else:
            await self._check_target()
        self.target.open_stream()
        self._opened, self._stream_ended = time.monotonic(), True  # the next reopen follows its end

    async def _set_serving(self, serving: bool) -> None:
        if serving != self.serving:
            self.serving = serving
            log.warning("router health: %s", "SERVING" if serving else "NOT_SERVING")
            if self.on_serving:
                await self.on_serving(serving)

    async def _run_step(self, plan: StepPlan, trace) -> None:
        draft_step = 0
        if self.speculator:
            plan, draft_step = await self._speculate(plan, trace)
        self.scheduler.commit(plan)
        try:
            result = await self._step(plan, draft_step, trace)
        except TandemError as e:
            self._fail_running(e)
            await self._reset_target()  # before any new sequence reaches the target
            return
        self._postprocess(plan, result)
        trace.done(plan, result)

    async def _speculate(self, plan: StepPlan, trace=NO_STEP) -> tuple[StepPlan, int]:
        plan, draft_step, unserved = await self.speculator.propose(plan, self._last_step, self.scheduler.draft_cap, trace)
        if unserved is None:  # the draft service failed
            self.scheduler.draft_lost()
        for seq in unserved or ():
            self.scheduler.stop_speculating(seq)
        return self.speculator.mark_hidden(plan), draft_step

    async def _step(self, plan: StepPlan, draft_step: int = 0, trace=NO_STEP):
        request = StepRequest(step_id=next(self._step_ids), ops=plan.ops, entries=plan.entries, draft_step_id=draft_step)
        started = time.perf_counter()
        with trace.target_call(request) as metadata:
            result = await self.target.step(request, metadata)
        self.figures.on_step(time.perf_counter() - started, plan.entries, result.compute_ms)
        self._last_step = request.step_id
        return result

    def _postprocess(self, plan: StepPlan, result) -> None:
        self.kv_pages_free = result.kv_pages_free
        if self.speculator:
            self.speculator.stats.record_verified(plan.entries, result.results)
        out = postprocess(self.scheduler, plan, result.results, result.kv_pages_free)
        if out.kv_diverged:
            self.figures.kv_mirror_mismatches += 1
            log.warning("KV page view diverged: router %d free, target %d", self.scheduler.kv.free_pages,
                        result.kv_pages_free)
        for emitted in out.emitted:
            seq = emitted.seq
            self.figures.on_tokens(seq, len(emitted.delta.tokens))
            seq.request.queue.put_nowait(emitted.delta)
            if seq.finished and self.speculator:
                self.speculator.finished(seq)
            if seq.request.finished:
                self._retire(seq.request)

    def _fail_running(self, error: TandemError) -> None:
        """A failed step leaves the target's state unknown: fail every request it ran and start
        the target afresh (recycled sequences go too); waiting requests are unaffected."""
        log.error("step failed: %s; failing %d running requests", error, len(self._running_requests()))
        self.figures.step_errors_total += 1
        for request in self._running_requests():
            self._fail(request, error)
        self.scheduler.reset()

    def _fail(self, request: Request, error: TandemError) -> None:
        """Ends `request` with `error` (its client gets it as the stream's status)."""
        request.queue.put_nowait(error)
        self.figures.mark_failed(request)
        self.tracing.failed(request, error)
        self.cancel(request)

    def _running_requests(self) -> list[Request]:
        return [r for r in self._requests if any(s.live for s in (r.parent, *r.choices) if s is not None)]

    async def _check_target(self) -> None:
        """The step stream is (re)opening. A target that restarted holds none of the sequences
        the router's view says it does (recycled ones in the prefix cache, above all), and counts
        its steps from 0: drop that view and start afresh before a step names any of them."""
        try:
            await self.target.check()
        except Unavailable as e:
            self._lose_target(e)
            await self._reset_target()

    def _adopt(self, info: EngineInfo) -> None:
        """A restarted target (holding nothing) may come back with other limits (its KV cache,
        max_num_sequence): the router schedules against them from now on, and fails the waiting
        requests that can never fit them. Another model does not match the router's tokenizer:
        requests fail (FAILED_PRECONDITION) until the target serves the router's model again."""
        if change := _model_change(self.info, info):
            self._wrong_target = (f"the target service restarted with another model ({change}); restart the"
                                  " router with that model, or the target with the router's")
        else:
            try:
                limits = resolve_limits(self.config, info, *self._draft_limits)
                self._wrong_target = ""
            except InvalidArgument as e:
                self._wrong_target = f"the restarted target service does not fit the router's flags: {e}"
        if self._wrong_target:
            log.error("%s", self._wrong_target)
            return
        if limits != self.limits:
            log.warning("the target came back with other limits: %s (was %s)", limits, self.limits)
        self.info, self.limits, self.kv_pages_free = info, limits, info.kv_pages_total
        for request, why in self.scheduler.adopt(limits):
            self._fail(request, NeverFits(f"{why} since the target service restarted"))

    def _lose_target(self, error: TandemError) -> None:
        if self._running_requests():
            self._fail_running(error)
        else:
            self.scheduler.reset()

    async def _reset_target(self) -> None:
        """Until the target has dropped every sequence, nothing new is scheduled: a target that
        stays down fails the requests that wait (UNAVAILABLE) rather than leaking them."""
        while True:
            waiting = list(self._requests)  # one that comes during an attempt gets a whole one
            try:
                reset = await self.target.reset()
            except Unavailable as error:
                log.warning("target reset failed: %s; retrying", error)
                await self._set_serving(False)
                for request in waiting:
                    if request in self._requests:
                        self._fail(request, error)
                self.scheduler.reset()
                await asyncio.sleep(RESET_RETRY_S)
                continue
            self._last_step = reset.last_step_id
            if reset.restarted:
                log.warning("the router's prefix cache was dropped: the target restarted")
                self.figures.target_restarts += 1
                self._adopt(reset.info)
            await self._set_serving(not self._wrong_target)
            return


def _model_change(was: EngineInfo, now: EngineInfo) -> str:
    """What makes `now` a model the router's tokenizer (and the draft head) cannot serve ('' if
    nothing does). Not the name: it is the target's folder (`float32`, `bfloat16` for ours)."""
    fields = ("architecture", "vocab_size", "hidden_size")
    return ", ".join(f"{f} {getattr(now, f)}, was {getattr(was, f)}" for f in fields if getattr(now, f) != getattr(was, f))
