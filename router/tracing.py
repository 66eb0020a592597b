"""The router's spans and request logs.

Per request, a SERVER span `generate` (the child of the client's span when its metadata carries
a traceparent) with OpenTelemetry GenAI attributes and MLC-LLM's trace points as events: add
request, start/finish tokenize, start/finish prefill, first token, then finish, cancelled (the
client went away) or error (a failed step, a target that is down: the span's status is ERROR).

Per engine step, a span `step` with CLIENT children `draft` (the Draft call) and `target.step`
(the target's Step call), whose trace context travels in the gRPC metadata; its events are
the step's phases (start/finish draft, prefill, decode, verify). A step serves many requests
but a span has one parent: the step is the child of the oldest request it serves (the first
submitted, whose trace so holds the longest run of steps) and links to the other requests'
spans. Draft and verify events live on step spans, not on request spans: a long generation
would overflow a span's event limit (128 by default) and lose its finish event.

When tracing is off, nothing here builds attributes or keeps state; the logs are written
either way.
"""

import logging
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

from opentelemetry import trace
from opentelemetry.trace import INVALID_SPAN, Span, SpanKind, Status, StatusCode

from router.request import Request
from router.step_plan import StepPlan
from tandem.ops import EntryKind, StepRequest, StepResult
from tandem.security.api_keys import bearer_key, key_id
from tandem.telemetry.tracing import Tracing, context_from, ending, ids, links_to, metadata, step_phases

log = logging.getLogger(__name__)


@dataclass(eq=False, slots=True)
class _RequestTrace:
    span: Span
    order: int  # submission order: the oldest request parents a step
    prefill_started: bool = False
    prefill_finished: bool = False
    first_token: bool = False
    error: str = ""  # why the request failed, if it did


class StepTrace:
    """One step's span; its calls' CLIENT spans; the events of the requests it serves."""

    def __init__(self, tracer: trace.Tracer, span: Span, served: dict[Request, _RequestTrace]):
        self.tracer = tracer
        self.span = span
        self.served = served

    @contextmanager
    def call(self, name: str, phases: tuple[str, ...]) -> Iterator[tuple | None]:
        """A CLIENT span around one RPC; yields the metadata that continues it."""
        for phase in phases:
            self.span.add_event(f"start {phase}")
        child = self.tracer.start_span(name, context=trace.set_span_in_context(self.span), kind=SpanKind.CLIENT)
        with ending(child):
            yield metadata(child)
        for phase in phases:
            self.span.add_event(f"finish {phase}")

    def draft_call(self):
        return self.call("draft", ("draft",))

    def target_call(self, request: StepRequest):
        self.span.set_attributes({
            "tandem.step_id": request.step_id,
            "tandem.draft_step_id": request.draft_step_id,
            "tandem.draft_tokens": sum(e.num_draft_tokens for e in request.entries),
        })
        return self.call("target.step", step_phases(request.entries))

    def done(self, plan: StepPlan, result: StepResult) -> None:
        """After postprocess: the step's figures and the requests' prefill and first tokens."""
        self.span.set_attribute("tandem.accepted_tokens", sum(r.num_accepted for r in result.results))
        served = {r: state for r, state in self.served.items() if state.span.is_recording()}  # not cancelled meanwhile
        for entry, seq in zip(plan.entries, plan.seqs):
            state = served.get(seq.request)
            if state and entry.kind is EntryKind.PREFILL and entry.sample and not state.prefill_finished:
                state.prefill_finished = True
                state.span.add_event("finish prefill")
        for request, state in served.items():
            if not state.first_token and any(s.output_ids for s in request.choices):
                state.first_token = True
                state.span.add_event("first token")


class _NoStep:
    def draft_call(self):
        return nullcontext()

    def target_call(self, request):
        return nullcontext()

    def done(self, plan, result) -> None:
        pass


NO_STEP = _NoStep()


class RouterTracing:
    """Owns the request spans of requests in flight (started by the servicer, ended by it)."""

    def __init__(self, tracing: Tracing, model: str):
        self.tracing = tracing
        self.model = model
        self._requests: dict[Request, _RequestTrace] = {}
        self._submitted = 0

    def start_request(self, grpc_metadata, operation: str) -> Span:
        """The request's SERVER span, the child of the client's span if it sent one."""
        if not self.tracing.enabled:
            return INVALID_SPAN
        parent = context_from(grpc_metadata or ())
        attributes = {"gen_ai.operation.name": operation, "gen_ai.request.model": self.model}
        if (key := bearer_key(grpc_metadata)) is not None:  # who asked, never the key itself
            attributes["tandem.api_key_id"] = key_id(key)
        return self.tracing.tracer.start_span("generate", context=parent, kind=SpanKind.SERVER, attributes=attributes)

    def added(self, request: Request, span: Span) -> None:
        spec = request.spec
        log.info("request accepted: %d prompt tokens, n=%d, max_tokens=%d", len(spec.prompt_ids), spec.n,
                 spec.max_tokens, extra={"request_id": spec.request_id, **ids(span)})
        if not span.is_recording():
            return
        self._submitted += 1
        self._requests[request] = _RequestTrace(span, self._submitted)
        span.set_attributes(_request_attributes(request))
        span.add_event("add request")

    def failed(self, request: Request, error: Exception) -> None:
        """The request ends with `error`; finished() follows and records it on the span."""
        state = self._requests.get(request)
        if state:
            state.error = f"{type(error).__name__}: {error}"

    def finished(self, request: Request, reason: str) -> None:
        """The request left the engine; `reason`: the one the figures counted it under (stop,
        length, cancelled or error)."""
        state = self._requests.pop(request, None)
        span = state.span if state else INVALID_SPAN
        reasons = _choice_reasons(request, failed=reason == "error")
        output = sum(len(s.output_ids) for s in request.choices)
        log.info("request finished: %d prompt + %d completion tokens, finish %s", len(request.spec.prompt_ids),
                 output, ",".join(reasons), extra={"request_id": request.spec.request_id, **ids(span)})
        if not span.is_recording():
            return
        span.set_attributes({
            "gen_ai.usage.input_tokens": len(request.spec.prompt_ids),
            "gen_ai.usage.output_tokens": output,
            "gen_ai.response.finish_reasons": reasons,
            "tandem.cached_prompt_tokens": request.cached_prompt_tokens,
            "tandem.draft_tokens": sum(s.draft_tokens for s in request.choices),
            "tandem.accepted_draft_tokens": sum(s.accepted_draft_tokens for s in request.choices),
        })
        if reason == "error":
            span.add_event("error", {"message": state.error or "failed"})
            span.set_status(Status(StatusCode.ERROR, state.error or "failed"))
        else:
            span.add_event("cancelled" if "cancelled" in reasons else "finish")

    def step(self, plan: StepPlan):
        """A context manager yielding the step's StepTrace (NO_STEP when no traced request is in
        it: ops-only steps make no trace of their own)."""
        if not self._requests:
            return nullcontext(NO_STEP)
        served = {}
        for seq in plan.seqs:
            if seq.request not in served and seq.request in self._requests:
                served[seq.request] = self._requests[seq.request]
        if not served:
            return nullcontext(NO_STEP)
        return self._step_span(plan, served)

    @contextmanager
    def _step_span(self, plan: StepPlan, served: dict) -> Iterator[StepTrace]:
        oldest = min(served.values(), key=lambda s: s.order)
        others = [s.span for s in served.values() if s is not oldest]
        span = self.tracing.tracer.start_span(
            "step", context=trace.set_span_in_context(oldest.span), links=links_to(others),
            attributes={
                "tandem.request_ids": [r.spec.request_id for r in served],
                "tandem.batch_size": len(plan.entries),
                "tandem.prefill_tokens": sum(len(e.token_ids) for e in plan.entries if e.kind is EntryKind.PREFILL),
            },
        )
        for entry, seq in zip(plan.entries, plan.seqs):
            state = served.get(seq.request)
            if state and entry.kind is EntryKind.PREFILL and not state.prefill_started:
                state.prefill_started = True
                state.span.add_event("start prefill")
        with ending(span):
            yield StepTrace(self.tracing.tracer, span, served)


def _choice_reasons(request: Request, failed: bool) -> list[str]:
    """Each choice's finish reason; a failed request's unfinished choices (cancelled when it
    was failed) end with "error"."""
    reasons = [s.finish_reason.value if s.finish_reason else "" for s in request.choices]
    if failed:
        reasons = ["error" if r in ("cancelled", "") else r for r in reasons]
    return reasons


def _request_attributes(request: Request) -> dict:
    spec = request.spec
    p = spec.sampler
    attributes = {
        "gen_ai.request.id": spec.request_id,  # no GenAI attribute names a request id yet
        "tandem.request_id": spec.request_id,
        "gen_ai.request.max_tokens": spec.max_tokens,
        "gen_ai.request.temperature": p.temperature,
        "gen_ai.request.top_p": p.top_p,
        "gen_ai.request.top_k": p.top_k,
        "gen_ai.request.choice.count": spec.n,
        "tandem.n": spec.n,
        "tandem.prompt_tokens": len(spec.prompt_ids),
        "tandem.speculate": spec.speculate,
    }
    if p.seed is not None:
        attributes["gen_ai.request.seed"] = p.seed
    if spec.stop:
        attributes["gen_ai.request.stop_sequences"] = list(spec.stop)
    return attributes

