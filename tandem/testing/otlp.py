"""A small in-process OTLP/gRPC trace receiver for tests (no Jaeger here): services export to
it as they would to a collector, and tests read the spans back, flattened."""

import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


@dataclass(frozen=True, slots=True)
class ReceivedSpan:
    service: str  # the resource's service.name
    name: str
    kind: int  # opentelemetry.proto.trace.v1.Span.SpanKind
    trace_id: str  # hex
    span_id: str
    parent_span_id: str  # "" for a root span
    attributes: dict
    events: tuple[str, ...]
    links: tuple[tuple[str, str], ...]  # (trace_id, span_id)


class OtlpReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    """Serves the OTLP TraceService on 127.0.0.1 (a free port); `endpoint` is what
    OTEL_EXPORTER_OTLP_ENDPOINT takes."""

    def __init__(self):
        self._spans: list[ReceivedSpan] = []
        self._cond = threading.Condition()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "OtlpReceiver":
        self._server.start()
        return self

    def __exit__(self, *_) -> None:
        self._server.stop(0).wait()

    def Export(self, request, context):
        spans = [span for rs in request.resource_spans for span in _flatten(rs)]
        with self._cond:
            self._spans.extend(spans)
            self._cond.notify_all()
        return trace_service_pb2.ExportTraceServiceResponse()

    def spans(self) -> list[ReceivedSpan]:
        with self._cond:
            return list(self._spans)

    def wait_for(self, done: Callable[[list[ReceivedSpan]], bool], timeout: float) -> list[ReceivedSpan]:
        """The spans once `done(spans)` holds; raises TimeoutError with what came otherwise."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not done(list(self._spans)):
                left = deadline - time.monotonic()
                if left <= 0:
                    names = sorted({(s.service, s.name) for s in self._spans})
                    raise TimeoutError(f"spans never matched in {timeout} s; got {names}")
                self._cond.wait(left)
            return list(self._spans)


def _flatten(resource_spans) -> list[ReceivedSpan]:
    resource = _attributes(resource_spans.resource.attributes)
    service = resource.get("service.name", "")
    return [
        ReceivedSpan(
            service=service, name=s.name, kind=s.kind, trace_id=s.trace_id.hex(), span_id=s.span_id.hex(),
            parent_span_id=s.parent_span_id.hex(), attributes=_attributes(s.attributes),
            events=tuple(e.name for e in s.events),
            links=tuple((link.trace_id.hex(), link.span_id.hex()) for link in s.links),
        )
        for scope in resource_spans.scope_spans
        for s in scope.spans
    ]


def _attributes(pairs) -> dict:
    return {kv.key: _value(kv.value) for kv in pairs}


def _value(v):
    which = v.WhichOneof("value")
    if which == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, which) if which else None
