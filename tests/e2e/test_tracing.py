"""Tracing through the three services as processes (`tandem up` with an EAGLE draft), exported
over OTLP/gRPC to an in-process receiver; JSON logs with the same trace ids."""

import json
import os
import signal
import subprocess
import sys

import grpc

from tandem.bench.services import free_port
from tandem.client import health
from tandem.testing.otlp import OtlpReceiver, ReceivedSpan
from tandem.v1 import generate_pb2, generate_pb2_grpc
from tests.e2e.conftest import ROOT
from tests.e2e.test_up import wait_serving

SERVER, CLIENT = 2, 3  # opentelemetry.proto.trace.v1.Span.SpanKind
SERVICES = {"tandem-router", "tandem-target", "tandem-draft"}
# `tandem up` would otherwise bind the fixed ports 9400-9402 (another run's).
NO_METRICS = ("--router-metrics-port", "0", "--target-metrics-port", "0", "--draft-metrics-port", "0")
REQUEST_EVENTS = {"add request", "start tokenize", "finish tokenize", "start prefill", "finish prefill",
                  "first token", "finish"}


def _generate(address: str, request_id: str, prompt: str) -> list:
    params = generate_pb2.SamplingParams(max_tokens=8, temperature=0)
    with grpc.insecure_channel(address) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        return list(stub.Generate(generate_pb2.GenerateRequest(request_id=request_id, prompt=prompt, params=params),
                                  timeout=120))


def _request_span(spans: list[ReceivedSpan], request_id: str) -> ReceivedSpan | None:
    found = [s for s in spans if s.name == "generate" and s.attributes.get("tandem.request_id") == request_id]
    return found[0] if found else None


def _trace_complete(request_id: str):
    """The request's trace has a draft prefill, every router call has its server span, and
    every span's parent is in it (spans come from three processes, in any order)."""
    def done(spans: list[ReceivedSpan]) -> bool:
        root = _request_span(spans, request_id)
        if root is None:
            return False
        trace = [s for s in spans if s.trace_id == root.trace_id]
        ids = {s.span_id for s in trace}
        calls = {s.span_id for s in trace if s.kind == CLIENT}
        answered = {s.parent_span_id for s in trace if s.kind == SERVER}
        return (any(s.name == "draft.prefill" for s in trace) and calls <= answered
                and all(s.parent_span_id in ids for s in trace if s is not root))
    return done


def _check_trace(spans: list[ReceivedSpan], request_id: str) -> str:
    """Asserts the shape of one request's trace; returns its trace id."""
    root = _request_span(spans, request_id)
    trace = [s for s in spans if s.trace_id == root.trace_id]
    by_id = {s.span_id: s for s in trace}
    parent = lambda s: by_id[s.parent_span_id]  # noqa: E731
    named = lambda service, name: [s for s in trace if s.service == service and s.name == name]  # noqa: E731

    assert root.service == "tandem-router" and root.kind == SERVER and root.parent_span_id == ""
    assert {s.service for s in trace} == SERVICES
    assert REQUEST_EVENTS <= set(root.events), root.events
    a = root.attributes
    assert a["gen_ai.operation.name"] == "text_completion" and a["gen_ai.request.max_tokens"] == 8
    assert a["gen_ai.request.temperature"] == 0 and a["gen_ai.usage.output_tokens"] == 8
    assert a["gen_ai.response.finish_reasons"] == ["length"] and a["gen_ai.usage.input_tokens"] > 0
    assert a["tandem.draft_tokens"] > 0 and "tandem.accepted_draft_tokens" in a

    steps = named("tandem-router", "step")
    assert steps and all(parent(s) is root and s.attributes["tandem.request_ids"] == [request_id] for s in steps)
    step_events = {e for s in steps for e in s.events}
    assert {"start prefill", "finish prefill", "start draft", "finish draft", "start verify", "finish verify"} <= step_events
    assert sum(s.attributes["tandem.draft_tokens"] for s in steps) == a["tandem.draft_tokens"]
    assert all("tandem.accepted_tokens" in s.attributes and s.attributes["tandem.batch_size"] == 1 for s in steps)

    for name in ("draft", "target.step"):
        calls = named("tandem-router", name)
        assert calls and all(c.kind == CLIENT and parent(c).name == "step" for c in calls)

    target_steps = named("tandem-target", "tandem.v1.TargetEngine/Step")
    assert target_steps and all(s.kind == SERVER and parent(s).name == "target.step" for s in target_steps)
    target_events = {e for s in target_steps for e in s.events}
    assert {"start embedding", "finish embedding", "start prefill", "finish prefill", "start verify",
            "finish verify"} <= target_events
    assert {"tandem.batch_size", "tandem.seq_ids", "tandem.accepted_tokens"} <= set(target_steps[0].attributes)

    drafts = named("tandem-draft", "tandem.v1.DraftEngine/Draft")
    assert drafts and all(s.kind == SERVER and parent(s).name == "draft" for s in drafts)
    assert any({"start draft", "finish draft"} <= set(s.events) for s in drafts)
    prefills = named("tandem-draft", "draft.prefill")
    assert prefills and all(parent(p) in target_steps for p in prefills)
    assert all(p.links and p.links[0][1] in {d.span_id for d in drafts} for p in prefills)
    return root.trace_id


def test_one_request_is_one_trace_across_router_target_and_draft(tiny_model, tmp_path):
    from tandem.models.eagle_io import random_eagle_checkpoint

    head = random_eagle_checkpoint(tmp_path / "head", tiny_model, seed=1)
    router, target, draft = free_port(), free_port(), free_port()
    with OtlpReceiver() as receiver:
        env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
        env.update(OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint, OTEL_BSP_SCHEDULE_DELAY="50", PYTHONUNBUFFERED="1")
        up = subprocess.Popen(
            [sys.executable, "-m", "tandem.cli", "--log-format", "json", "up", "--model", str(tiny_model),
             "--draft", "eagle", "--draft-model", str(head), "--router-port", str(router), "--target-port", str(target),
             "--draft-port", str(draft), "--spec-draft-length", "3", *NO_METRICS],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        try:
            wait_serving(f"127.0.0.1:{router}", up)
            assert len(_generate(f"127.0.0.1:{router}", "trace-1", "The quick brown fox")) > 0
            spans = receiver.wait_for(_trace_complete("trace-1"), timeout=60)
            first = _check_trace(spans, "trace-1")
            assert len(_generate(f"127.0.0.1:{router}", "trace-2", "Once upon a time")) > 0
            spans = receiver.wait_for(_trace_complete("trace-2"), timeout=60)
            second = _check_trace(spans, "trace-2")
        finally:
            up.send_signal(signal.SIGTERM)
            code = up.wait(timeout=60)
            output = up.stdout.read()
    assert code == 0, output[-3000:]
    assert first != second
    assert health(f"127.0.0.1:{router}", timeout=1.0, quiet=True) == 1
    # The router's JSON log lines name the request and its trace.
    lines = [json.loads(line) for line in output.splitlines() if line.startswith("{")]
    finished = [line for line in lines if line["message"].startswith("request finished")]
    assert {(line["request_id"], line["trace_id"], line["service"]) for line in finished} == {
        ("trace-1", first, "tandem-router"), ("trace-2", second, "tandem-router")}
    assert {line["service"] for line in lines} >= SERVICES


def test_sigterm_flushes_the_spans_still_queued(tiny_model):
    """With a batch delay far beyond the test, spans leave only by the shutdown flush."""
    router, target = free_port(), free_port()
    with OtlpReceiver() as receiver:
        env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
        env.update(OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint, OTEL_BSP_SCHEDULE_DELAY="600000")
        up = subprocess.Popen(
            [sys.executable, "-m", "tandem.cli", "up", "--model", str(tiny_model), "--draft", "none",
             "--router-port", str(router), "--target-port", str(target), *NO_METRICS],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        try:
            wait_serving(f"127.0.0.1:{router}", up)
            _generate(f"127.0.0.1:{router}", "flushed", "The quick brown fox")
            queued = len(receiver.spans())
        finally:
            up.send_signal(signal.SIGTERM)
            code = up.wait(timeout=60)
        assert code == 0, up.stdout.read()[-3000:]
        spans = receiver.wait_for(lambda s: _request_span(s, "flushed") is not None, timeout=10)
    assert queued == 0
    root = _request_span(spans, "flushed")
    assert {s.service for s in spans if s.trace_id == root.trace_id} == {"tandem-router", "tandem-target"}
