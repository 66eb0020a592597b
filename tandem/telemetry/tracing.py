"""OpenTelemetry tracing of one service, configured by the standard OTEL_* variables, and the
trace context carried over gRPC metadata and the peer stream (W3C traceparent).

Tracing is on when an exporter is asked for: OTEL_TRACES_EXPORTER (otlp, console), or an OTLP
endpoint (OTEL_EXPORTER_OTLP_ENDPOINT / OTEL_EXPORTER_OTLP_TRACES_ENDPOINT) with the exporter
left unset. Otherwise no SDK provider is built: the API's no-op tracer hands out non-recording
spans and callers skip building attributes (`span.is_recording()`). The SDK reads the rest
(OTEL_BSP_*, OTEL_TRACES_SAMPLER, OTEL_EXPORTER_OTLP_* headers, timeout, insecure) itself.

We never set the global tracer provider: each service builds its provider once and passes its
tracer down, so several services in one process (the services tests) keep their own
service.name. Propagation uses the API's global propagator (OTEL_PROPAGATORS, default W3C
tracecontext + baggage), which opentelemetry.propagate requires.
"""

import logging
import os
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.trace import INVALID_SPAN, Link, Span, SpanKind, Status, StatusCode

log = logging.getLogger(__name__)

SERVICE_NAMES = {"router": "tandem-router", "target": "tandem-target", "draft": "tandem-draft"}
_ENDPOINTS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")


def service_name(kind: str, environ: Mapping[str, str] = os.environ) -> str:
    """OTEL_SERVICE_NAME, else tandem-<kind> (router, target, draft)."""
    return environ.get("OTEL_SERVICE_NAME") or SERVICE_NAMES.get(kind, f"tandem-{kind}")


@dataclass(frozen=True, slots=True)
class Tracing:
    """A service's tracer; `provider` is None when tracing is off (the no-op tracer)."""

    tracer: trace.Tracer
    provider: object = None  # opentelemetry.sdk.trace.TracerProvider

    @property
    def enabled(self) -> bool:
        return self.provider is not None

    @classmethod
    def off(cls) -> "Tracing":
        return cls(trace.NoOpTracer())

    def shutdown(self) -> None:
        """Exports the spans still queued (graceful stop); the provider is unusable after."""
        if self.provider is not None:
            self.provider.shutdown()


def exporters_wanted(environ: Mapping[str, str] = os.environ) -> list[str]:
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return []
    raw = environ.get("OTEL_TRACES_EXPORTER")
    if raw is None:
        return ["otlp"] if any(environ.get(name) for name in _ENDPOINTS) else []
    return [name.strip().lower() for name in raw.split(",") if name.strip() and name.strip().lower() != "none"]


def setup_tracing(kind: str, environ: Mapping[str, str] = os.environ) -> Tracing:
    """The tracer of service `kind` (router, target, draft), from the OTEL_* variables."""
    wanted = exporters_wanted(environ)
    if not wanted:
        return Tracing.off()
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: service_name(kind, environ)}))
    for exporter in _exporters(wanted, environ):
        provider.add_span_processor(BatchSpanProcessor(exporter))  # OTEL_BSP_* read by the SDK
    log.info("tracing on: %s exports to %s", service_name(kind, environ), ",".join(wanted))
    return Tracing(provider.get_tracer(f"tandem.{kind}"), provider)


def _exporters(names: Iterable[str], environ: Mapping[str, str]) -> Iterator[object]:
    for name in names:
        if name == "otlp":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            # The SDK reads headers, timeout, certificates from os.environ itself; the endpoint
            # comes from `environ` so that a caller's mapping is honoured too.
            endpoint = next((environ[n] for n in _ENDPOINTS if environ.get(n)), None)
            yield OTLPSpanExporter(endpoint=endpoint)
        elif name == "console":
            from opentelemetry.sdk.trace.export import ConsoleSpanExporter

            yield ConsoleSpanExporter()
        else:
            log.warning("OTEL_TRACES_EXPORTER %r is not supported here (otlp, console, none): ignored", name)


# -- context propagation ----------------------------------------------------------------------


def carrier(span: Span) -> dict[str, str]:
    """The W3C headers (traceparent, tracestate) naming `span` as the parent; empty when the
    span does not record (nothing to continue)."""
    if not span.is_recording():
        return {}
    headers: dict[str, str] = {}
    propagate.inject(headers, context=trace.set_span_in_context(span))
    return headers


def metadata(span: Span) -> tuple[tuple[str, str], ...] | None:
    """gRPC metadata that continues `span` in the called service (None: nothing to send)."""
    headers = carrier(span)
    return tuple(headers.items()) if headers else None


def context_from(pairs: Iterable[tuple[str, str]]) -> Context | None:
    """The parent context from W3C headers (gRPC metadata or a peer message); None if absent."""
    headers = {key: value for key, value in pairs if key in ("traceparent", "tracestate")}
    if "traceparent" not in headers:
        return None
    context = propagate.extract(headers)
    return context if trace.get_current_span(context).get_span_context().is_valid else None


def server_span(tracing: Tracing, name: str, headers: Iterable[tuple[str, str]], root_ok: bool = True) -> Span:
    """A SERVER span for one RPC (or one message of a stream), the child of the caller's span
    (from `headers`: the call's metadata or the message's trace context). With no caller
    context, a root span only if `root_ok`: work the caller did not trace (ops-only steps)
    would otherwise show up as lone one-span traces."""
    if not tracing.enabled:
        return INVALID_SPAN
    parent = context_from(headers)
    if parent is None and not root_ok:
        return INVALID_SPAN
    service, method = name.rsplit("/", 1)
    attributes = {"rpc.system": "grpc", "rpc.service": service, "rpc.method": method}
    return tracing.tracer.start_span(name, context=parent, kind=SpanKind.SERVER, attributes=attributes)


@contextmanager
def ending(span: Span) -> Iterator[Span]:
    """Ends `span` on exit, marking it as an error when an exception leaves (a cancellation is
    none: the caller went away). The span is not made current: callers pass it explicitly."""
    try:
        yield span
    except Exception as e:
        fail(span, e)
        raise
    finally:
        span.end()


def fail(span: Span, error: BaseException) -> None:
    if span.is_recording():
        span.record_exception(error)
        span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))


def links_to(spans: Iterable[Span]) -> list[Link]:
    return [Link(s.get_span_context()) for s in spans if s.get_span_context().is_valid]


def ids(span: Span) -> dict[str, str]:
    """trace_id and span_id (hex) of a span, for log records; empty when it has none."""
    context = span.get_span_context()
    if not context.is_valid:
        return {}
    return {"trace_id": format(context.trace_id, "032x"), "span_id": format(context.span_id, "016x")}


def span_continuing(tracing: Tracing, name: str, headers: Iterable[tuple[str, str]], link: Span = INVALID_SPAN) -> Span:
    """A span for work on a message received with W3C `headers` (the peer stream): the child of
    the sender's span, linked to `link` (the span of the call doing the work); without headers,
    the child of `link`."""
    if not tracing.enabled:
        return INVALID_SPAN
    parent = context_from(headers)
    if parent is None:
        if not link.is_recording():
            return INVALID_SPAN
        return tracing.tracer.start_span(name, context=trace.set_span_in_context(link))
    return tracing.tracer.start_span(name, context=parent, links=links_to([link]))


def step_phases(entries) -> tuple[str, ...]:
    """What a step's entries ask for, as MLC's trace points name it: prefill (prompt chunks),
    decode (plain), verify (drafts). One forward pass serves them all."""
    kinds = {"prefill" if e.kind.name == "PREFILL" else "verify" if e.num_draft_tokens else "decode" for e in entries}
    return tuple(k for k in ("prefill", "decode", "verify") if k in kinds)
