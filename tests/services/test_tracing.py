"""Spans of requests that share steps, of a cancelled request and of a failed one, through real
services in this process (each with its own tracer provider and an in-memory exporter)."""

import time

import grpc
import pytest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from tandem.errors import TandemError
from tandem.telemetry.tracing import Tracing
from tandem.v1 import generate_pb2
from tests.services.harness import start_services


def _tracing(service: str) -> tuple[Tracing, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return Tracing(provider.get_tracer(service), provider), exporter


@pytest.fixture(scope="module")
def traced(tiny_model, tmp_path_factory):
    from tandem.models.eagle_io import random_eagle_checkpoint

    head = random_eagle_checkpoint(tmp_path_factory.mktemp("head") / "eagle", tiny_model, seed=1)
    tracings = {kind: _tracing(f"tandem-{kind}") for kind in ("router", "target", "draft")}
    services = start_services(tiny_model, draft_model=head, router={"spec_draft_length": 3},
                              tracing={kind: t for kind, (t, _) in tracings.items()})
    yield services, {kind: e for kind, (_, e) in tracings.items()}
    services.stop()


def _request(request_id: str, max_tokens: int) -> generate_pb2.GenerateRequest:
    params = generate_pb2.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return generate_pb2.GenerateRequest(request_id=request_id, prompt="The quick brown fox", params=params)


def _generate_span(exporter: InMemorySpanExporter, request_id: str, timeout: float = 30):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [s for s in exporter.get_finished_spans()
                 if s.name == "generate" and s.attributes.get("tandem.request_id") == request_id]
        if found:
            return found[0]
        time.sleep(0.02)
    raise AssertionError(f"no generate span for {request_id}")


def test_a_shared_step_is_the_child_of_the_oldest_request_and_links_the_others(traced):
    services, exporters = traced
    older = services.stub.Generate(_request("older", 48), timeout=60)
    next(older)  # submitted and decoding
    newer = list(services.stub.Generate(_request("newer", 6), timeout=60))
    rest = list(older)
    assert newer and rest
    old_span, new_span = _generate_span(exporters["router"], "older"), _generate_span(exporters["router"], "newer")
    assert old_span.context.trace_id != new_span.context.trace_id
    steps = [s for s in exporters["router"].get_finished_spans() if s.name == "step"]
    shared = [s for s in steps if set(s.attributes["tandem.request_ids"]) == {"older", "newer"}]
    assert shared, "the two requests never shared a step"
    for step in shared:
        assert step.parent.span_id == old_span.context.span_id
        assert [link.context.span_id for link in step.links] == [new_span.context.span_id]
        assert step.attributes["tandem.batch_size"] == 2
    alone = [s for s in steps if list(s.attributes["tandem.request_ids"]) == ["newer"]]
    assert all(s.parent.span_id == new_span.context.span_id and not s.links for s in alone)
    # the target's work for a shared step is in the older request's trace
    shared_ids = {s.context.span_id for s in shared}
    calls = {s.context.span_id for s in exporters["router"].get_finished_spans()
             if s.name == "target.step" and s.parent.span_id in shared_ids}
    target_steps = [s for s in exporters["target"].get_finished_spans() if s.parent and s.parent.span_id in calls]
    assert target_steps and all(s.context.trace_id == old_span.context.trace_id for s in target_steps)
    assert all(s.attributes["tandem.batch_size"] == 2 for s in target_steps)


def test_a_cancelled_request_ends_its_span_with_a_cancelled_event(traced):
    services, exporters = traced
    call = services.stub.Generate(_request("gone", 200), timeout=60)
    next(call)
    call.cancel()
    with pytest.raises(grpc.RpcError):
        list(call)
    span = _generate_span(exporters["router"], "gone")
    events = [e.name for e in span.events]
    assert "cancelled" in events and "finish" not in events
    assert span.attributes["gen_ai.response.finish_reasons"] == ("cancelled",)
    assert span.status.is_ok  # the client going away is no error of the server's


def test_a_failed_request_ends_its_span_with_an_error_event(traced):
    services, exporters = traced
    target = services.target_engine
    step = target.step

    def failing_step(request, *args, **kwargs):
        if not request.entries:
            return step(request, *args, **kwargs)
        target.step = step  # once
        raise TandemError("injected step failure")

    call = services.stub.Generate(_request("failed", 200), timeout=60)
    next(call)
    target.step = failing_step
    try:
        with pytest.raises(grpc.RpcError) as info:
            list(call)
    finally:
        target.step = step
    assert "injected step failure" in info.value.details()
    span = _generate_span(exporters["router"], "failed")
    events = {e.name: e for e in span.events}
    assert "error" in events and "cancelled" not in events and "finish" not in events
    assert "injected step failure" in events["error"].attributes["message"]
    assert span.attributes["gen_ai.response.finish_reasons"] == ("error",)
    assert not span.status.is_ok
    # the services still serve
    assert list(services.stub.Generate(_request("after", 4), timeout=60))


def test_a_request_span_names_its_api_key_by_hash_never_the_key(traced):
    from tandem.security.api_keys import key_id

    services, exporters = traced
    key = "sk-tracing-secret"
    list(services.stub.Generate(_request("keyed", 2), timeout=60, metadata=(("authorization", f"Bearer {key}"),)))
    span = _generate_span(exporters["router"], "keyed")
    assert span.attributes["tandem.api_key_id"] == key_id(key)
    spans = [s for e in exporters.values() for s in e.get_finished_spans()]
    assert not any(key in str(v) for s in spans for v in (*s.attributes.values(), *(a for e in s.events for a in e.attributes.values())))
