"""The router's calls travel on the services' streams (Steps, Drafts): a failed call answers in the
stream and the stream goes on; a failed or stalled step fails the running requests, never the
router; a failed draft call serves plain until the draft is healthy again; a stream that ended
while the router was idle (the service restarted) is opened again."""

import time

import grpc
import pytest

from draft_service.config import DraftConfig
from draft_service.server import start_draft
from tandem.models.eagle_io import random_eagle_checkpoint
from tandem.v1 import engine_pb2 as epb
from tandem.v1 import engine_pb2_grpc
from tandem.v1 import generate_pb2 as pb
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
    assert s.router_engine.counters.step_errors_total == 1
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
        assert speculator.stats.draft_failures == 1 and s.router_engine.counters.step_errors_total == 0
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
    assert s.router_engine.counters.step_errors_total == 0


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
        assert speculator.healthy and s.router_engine.counters.step_errors_total == 0
    finally:
        s.stop()
