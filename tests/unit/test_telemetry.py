"""Tracing set-up from OTEL_* variables, trace context carriers, and JSON log lines."""

import io
import json
import logging

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

from tandem.telemetry.logs import JsonFormatter
from tandem.telemetry.tracing import carrier, context_from, setup_tracing, span_continuing
from tandem.testing.otlp import OtlpReceiver


def test_tracing_is_off_without_an_exporter_and_its_spans_do_not_record():
    for environ in (
        {},
        {"OTEL_SERVICE_NAME": "x"},
        {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317", "OTEL_SDK_DISABLED": "true"},
        {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317", "OTEL_TRACES_EXPORTER": "none"},
    ):
        tracing = setup_tracing("router", environ)
        assert not tracing.enabled and tracing.provider is None, environ
        span = tracing.tracer.start_span("generate")
        assert not span.is_recording()
        assert carrier(span) == {}
        tracing.shutdown()


def test_an_endpoint_turns_otlp_on_and_spans_reach_the_receiver_with_the_service_name():
    with OtlpReceiver() as receiver:
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint}
        for kind, environ in (("target", env), ("draft", {**env, "OTEL_SERVICE_NAME": "my-draft"})):
            tracing = setup_tracing(kind, environ)
            assert tracing.enabled
            with tracing.tracer.start_as_current_span("work") as span:
                assert span.is_recording()
            tracing.shutdown()  # flushes: no wait for the batch
        spans = receiver.wait_for(lambda s: len(s) == 2, timeout=10)
    assert sorted(s.service for s in spans) == ["my-draft", "tandem-target"]


def test_a_carrier_continues_the_trace_and_links_the_consumer():
    tracer = TracerProvider().get_tracer("t")
    sender = tracer.start_span("sender")
    headers = carrier(sender)
    assert set(headers) == {"traceparent"}
    parent = context_from(headers.items())
    assert trace.get_current_span(parent).get_span_context().span_id == sender.get_span_context().span_id
    assert context_from([("other", "x")]) is None

    from tandem.telemetry.tracing import Tracing

    tracing = Tracing(tracer, provider=object())
    consumer = tracer.start_span("consumer")
    child = span_continuing(tracing, "work", headers.items(), consumer)
    assert child.parent.span_id == sender.get_span_context().span_id
    assert [link.context.span_id for link in child.links] == [consumer.get_span_context().span_id]
    orphan = span_continuing(tracing, "work", (), consumer)  # no headers: the consumer's child
    assert orphan.parent.span_id == consumer.get_span_context().span_id


def _json_logger() -> tuple[logging.Logger, io.StringIO]:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(JsonFormatter("tandem-router"))
    logger = logging.getLogger("tandem.test.json")
    logger.handlers[:] = [handler]
    logger.propagate = False
    logger.setLevel(logging.INFO)
    return logger, out


def test_json_log_lines_carry_service_request_and_trace_ids():
    logger, out = _json_logger()
    tracer = TracerProvider().get_tracer("t")
    logger.info("before any span")
    with tracer.start_as_current_span("generate") as span:
        logger.info("request accepted: %d tokens", 7, extra={"request_id": "req-1"})
    plain, accepted = (json.loads(line) for line in out.getvalue().splitlines())
    assert plain["message"] == "before any span" and "trace_id" not in plain and "request_id" not in plain
    context = span.get_span_context()
    assert accepted == {
        "time": accepted["time"], "level": "INFO", "logger": "tandem.test.json",
        "message": "request accepted: 7 tokens", "service": "tandem-router", "request_id": "req-1",
        "trace_id": format(context.trace_id, "032x"), "span_id": format(context.span_id, "016x"),
    }
    assert accepted["time"].endswith("+00:00")


def test_json_log_ids_passed_explicitly_win_over_the_current_span():
    logger, out = _json_logger()
    try:
        raise ValueError("boom")
    except ValueError:
        logger.exception("failed", extra={"trace_id": "ab" * 16, "span_id": "cd" * 8})
    line = json.loads(out.getvalue())
    assert line["trace_id"] == "ab" * 16 and line["level"] == "ERROR" and "ValueError: boom" in line["exception"]
