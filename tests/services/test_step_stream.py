"""The router's calls travel on the services' streams (Steps, Drafts): a failed call answers in the
stream and the stream goes on; a failed or stalled step fails the running requests, never the
router; a failed draft call serves plain until the draft is healthy again; a stream that ended
while the router was idle (the service restarted) is opened again."""

import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from draft_service.config import DraftConfig
from draft_service.server import start_draft
from tandem.models.eagle_io import random_eagle_checkpoint
from tandem.v1 import engine_pb2 as epb
from tandem.v1 import engine_pb2_grpc
from tandem.v1 import generate_pb2 as pb
from router.figures import snapshot
from router.metrics import router_families
from target_service.config import TargetConfig
from target_service.server import start_target
from tests.services.harness import generate, start_services

GREEDY = pb.SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def test_a_failed_step_answers_with_its_status_and_the_stream_goes_on(services):
    sampler = epb.SamplerConfig(top_p=1.0, repetition_penalty=1.0)
    steps = [
        epb.StepRequest(step_id=10**9 + 1, entries=[epb.StepEntry(seq_id=987654, token_ids=[1], sample=True)]),
        epb.StepRequest(step_id=10**9 + 2, ops=[epb.SequenceOp(add=epb.AddSequence(seq_id=777001, sampler=sampler))]),
        epb.StepRequest(step_id=10**9 + 3, ops=[epb.SequenceOp()]),
        epb.StepRequest(step_id=10**9 + 4, ops=[epb.SequenceOp(remove=epb.RemoveSequence(seq_id=777001))]),
    ]
    with grpc.insecure_channel(f"127.0.0.1:{services.target_port}") as ch:
        answers = list(engine_pb2_grpc.TargetEngineStub(ch).Steps(iter(steps), timeout=30))
    assert [a.step_id for a in answers] == [s.step_id for s in steps]  # one answer each, in order
    unknown, added, no_op, removed = answers
    assert unknown.error.code == grpc.StatusCode.NOT_FOUND.value[0] and "987654" in unknown.error.message
    assert no_op.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and no_op.error.message
    assert not added.HasField("error") and not removed.HasField("error")
    assert generate(services.stub, prompt="hi", params=GREEDY)[0]


@pytest.fixture
def own_services(tiny_model):
    s = start_services(tiny_model, router={"step_timeout_s": 2.0})
    yield s
    s.stop()


def _once(step, before=lambda: None, after=lambda: None):
    """An engine call with `before` / `after` run around its first one that runs a model."""
    seen = []

    def wrapped(request, *rest):
        first = bool(getattr(request, "entries", None) or getattr(request, "seqs", None)) and not seen
        if first:
            seen.append(request)
        if first:
            before()
        result = step(request, *rest)
        if first:
            after()
        return result

    return wrapped


def test_a_step_the_target_fails_fails_its_requests_and_the_next_request_is_served(own_services):
    s = own_services
    expected = generate(s.stub, prompt="hello", params=GREEDY)[0]
    s.target_engine.step = _once(s.target_engine.step, before=lambda: 1 / 0)
    with pytest.raises(grpc.RpcError) as info:
        generate(s.stub, prompt="hello", params=GREEDY)
    assert "target service failed a call: INTERNAL: ZeroDivisionError" in info.value.details()
    assert generate(s.stub, prompt="hello", params=GREEDY)[0] == expected
    assert s.router_engine.figures.step_errors_total == 1
    stats = s.wait_idle()
    assert stats.sequences_live == 0 and stats.kv_pages_free == stats.kv_pages_total


def test_a_stalled_step_is_unavailable_and_a_fresh_stream_serves_the_next_request(own_services):
    s = own_services
    expected = generate(s.stub, prompt="hello", params=GREEDY)[0]
    s.target_engine.step = _once(s.target_engine.step, after=lambda: time.sleep(3.0))  # > step_timeout_s
    with pytest.raises(grpc.RpcError) as info:
        generate(s.stub, prompt="hello", params=GREEDY)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE and "no answer to step_id" in info.value.details()
    # The stalled step's late answer went with the closed stream: it cannot pass for another's.
    assert generate(s.stub, prompt="hello", params=GREEDY)[0] == expected
    stats = s.wait_idle()
    assert stats.sequences_live == 0 and stats.kv_pages_free == stats.kv_pages_total


def test_a_draft_call_the_draft_fails_serves_plain_and_drafting_comes_back(tiny_model, tmp_path):
    head = random_eagle_checkpoint(tmp_path / "head", tiny_model, seed=3)
    s = start_services(tiny_model, draft_model=head)
    try:
        expected = generate(s.stub, prompt="hello", params=GREEDY)[0]
        speculator = s.router_engine.speculator
        s.draft_engine.draft = _once(s.draft_engine.draft, before=lambda: 1 / 0)
        assert generate(s.stub, prompt="hello", params=GREEDY)[0] == expected  # served plain
        assert speculator.stats.draft_failures == 1 and s.router_engine.figures.step_errors_total == 0
        deadline = time.monotonic() + 30
        while not speculator.healthy and time.monotonic() < deadline:  # its health probe resets it
            time.sleep(0.1)
        ids, _, _, last = generate(s.stub, prompt="hello", params=GREEDY)
        assert ids == expected and last.usage.draft_tokens > 0  # a fresh stream
    finally:
        s.stop()


def test_a_target_stream_that_ended_while_idle_is_opened_again(own_services):
    s = own_services
    expected = generate(s.stub, prompt="hello", params=GREEDY)[0]
    s.target_server.stop(0).wait()  # the target's server goes away between requests: the stream ends
    config = TargetConfig(model_dir=s.router_engine.config.model_dir, port=s.target_port,
                          kv_cache_tokens=8192, kv_page_size=8)
    s.target_server, *_ = start_target(config, engine=s.target_engine)
    for _ in range(2):  # the first after the restart too: the router opens a fresh stream
        assert generate(s.stub, prompt="hello", params=GREEDY)[0] == expected
    assert s.router_engine.figures.step_errors_total == 0


def test_a_target_restarted_while_idle_is_found_and_what_it_held_is_forgotten(own_services):
    """A new target process holds none of the sequences the router's prefix cache names: the
    router sees another instance before its next step and drops its view (it forked a recycled
    sequence the new target never had, failing the request)."""
    s = own_services
    prompt = "hello there, how are you today"  # recycled after the first request: the next forks it
    expected = generate(s.stub, prompt=prompt, params=GREEDY)[0]
    s.target_server.stop(0).wait()
    s.target_server, _, _, s.target_engine, _ = start_target(_target_config(s))  # a fresh process's engine
    for _ in range(2):
        assert generate(s.stub, prompt=prompt, params=GREEDY)[0] == expected
    counters = s.router_engine.figures
    assert counters.step_errors_total == 0 and counters.target_restarts == 1 and counters.kv_mirror_mismatches == 0
    samples = {m.name: m.value for family in router_families(snapshot(s.router_engine)) for m in family.samples}
    assert samples["tandem_router_target_restarts_total"] == 1


def _target_config(s) -> TargetConfig:
    return TargetConfig(model_dir=s.router_engine.config.model_dir, port=s.target_port,
                        kv_cache_tokens=8192, kv_page_size=8)


def _draft_health(s) -> int:
    with grpc.insecure_channel(f"127.0.0.1:{s.draft_port}") as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10).status


def _wait_for(condition, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def test_the_draft_is_serving_only_while_its_peer_stream_to_the_target_is_open(tiny_model, tmp_path):
    """Without the stream the draft has nothing to draft from: a router that saw it SERVING
    would re-prefill its running requests to speculate into failures."""
    head = random_eagle_checkpoint(tmp_path / "head", tiny_model, seed=3)
    s = start_services(tiny_model, draft_model=head)
    try:
        expected = generate(s.stub, prompt="hello", params=GREEDY)[0]
        assert _draft_health(s) == health_pb2.HealthCheckResponse.SERVING
        s.target_server.stop(0).wait()
        _wait_for(lambda: _draft_health(s) == health_pb2.HealthCheckResponse.NOT_SERVING, "the draft still says SERVING")
        s.target_server, _, _, s.target_engine, _ = start_target(_target_config(s))
        _wait_for(lambda: _draft_health(s) == health_pb2.HealthCheckResponse.SERVING, "the draft never came back")

        ids, _, _, last = generate(s.stub, prompt="hello", params=GREEDY)
        assert ids == expected and last.usage.draft_tokens > 0  # the draft waits for the new target's steps
        figures = snapshot(s.router_engine)
        assert figures.target_restarts_total == 1 and figures.draft_failures_total == 0
    finally:
        s.stop()


def test_a_draft_restarted_while_idle_speculates_again(tiny_model, tmp_path):
    head = random_eagle_checkpoint(tmp_path / "head", tiny_model, seed=3)
    s = start_services(tiny_model, draft_model=head)
    try:
        expected, _, _, last = generate(s.stub, prompt="hello", params=GREEDY)
        assert last.usage.draft_tokens > 0
        s.stop_draft()
        config = DraftConfig(method="eagle", model_dir=head, target_model_dir=tiny_model,
                             target_address=f"127.0.0.1:{s.target_port}", port=s.draft_port)
        s.draft_server, _, _, s.draft_engine, _ = start_draft(config)
        speculator = s.router_engine.speculator
        drafted = 0
        deadline = time.monotonic() + 30
        while drafted == 0:  # served (plain while the router finds the draft again), then drafted
            assert time.monotonic() < deadline, "the router never drafted on the restarted draft"
            ids, _, _, last = generate(s.stub, prompt="hello", params=GREEDY)
            assert ids == expected
            drafted = last.usage.draft_tokens
            time.sleep(0.1)
        assert speculator.healthy and s.router_engine.figures.step_errors_total == 0
    finally:
        s.stop()
