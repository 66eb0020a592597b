"""Overload control on the public port: a full queue refused with a retry pushback, a cap on
running requests, a cap on concurrent calls, and a deadline that expires mid-generation
freeing what the request held."""

import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.channels import open_channel
from tandem.grpc_server import RETRY_PUSHBACK
from tandem.testing.tiny import TINY_PROMPTS
from tandem.v1 import generate_pb2 as pb
from tandem.v1 import generate_pb2_grpc
from tests import reliability
from tests.services.harness import generate, start_services

LONG = pb.SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def services(tiny_model):
    s = start_services(tiny_model, router={"max_waiting": 1, "max_running_requests": 1, "max_concurrent_rpcs": 4})
    yield s
    s.stop()


def _stats(services):
    return services.stub.Stats(pb.StatsRequest(), timeout=10)


def _wait_for(predicate, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def _stream_in_background(stub, prompt):
    """Starts a long Generate; returns (call, thread, outcome dict)."""
    call = stub.Generate(pb.GenerateRequest(prompt=prompt, params=LONG), timeout=120)
    outcome = {}

    def drain():
        try:
            outcome["tokens"] = sum(len(c.token_ids) for r in call for c in r.choices)
        except grpc.RpcError as e:
            outcome["code"] = e.code()

    thread = threading.Thread(target=drain, daemon=True)
    thread.start()
    return call, thread, outcome


def test_a_full_queue_refuses_with_a_retry_pushback_and_running_requests_are_capped(services):
    first, t1, o1 = _stream_in_background(services.stub, TINY_PROMPTS[0])
    _wait_for(lambda: _stats(services).requests_running == 1)
    second, t2, o2 = _stream_in_background(services.stub, TINY_PROMPTS[1])
    _wait_for(lambda: _stats(services).requests_waiting == 1)
    stats = _stats(services)
    assert stats.requests_running == 1  # max_running_requests: the second waits its turn
    with pytest.raises(grpc.RpcError) as info:
        generate(services.stub, prompt=TINY_PROMPTS[2], params=LONG, timeout=30)
    error = info.value
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_waiting" in error.details()
    trailers = dict(error.trailing_metadata() or ())
    assert 100 <= int(trailers[RETRY_PUSHBACK]) <= 60_000, trailers
    reliability.bad_inputs()
    first.cancel()
    t1.join(30)
    t2.join(120)  # admitted once the first left
    assert o2.get("tokens") == 400, o2
    reliability.served(2)


def test_the_pushback_follows_the_drain_rate(services):
    """Requests finishing lately give a rate (the arithmetic is tests/unit/test_overload.py's):
    the hint is no longer the fixed guess of an idle router."""
    for prompt in TINY_PROMPTS[:3]:
        generate(services.stub, prompt=prompt, params=pb.SamplingParams(max_tokens=2, temperature=0))
    engine = services.router_engine
    assert engine.drain.per_second() > 0
    assert 100 <= engine.drain.retry_after_ms(1) <= 60_000


def test_a_client_with_the_retry_policy_waits_out_a_full_queue(services):
    """tandem's public retry policy (what `tandem generate` uses): the refused call is retried
    after the pushback, and is served once the queue has room."""
    first, t1, _ = _stream_in_background(services.stub, TINY_PROMPTS[0])
    _wait_for(lambda: _stats(services).requests_running == 1)
    second, t2, _ = _stream_in_background(services.stub, TINY_PROMPTS[1])
    _wait_for(lambda: _stats(services).requests_waiting == 1)
    refused = _stats(services).requests_refused_total
    with open_channel(f"127.0.0.1:{services.router_port}", retry=True) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        call = stub.Generate(pb.GenerateRequest(prompt=TINY_PROMPTS[2], params=pb.SamplingParams(
            max_tokens=4, temperature=0, ignore_eos=True)), timeout=60)
        _wait_for(lambda: _stats(services).requests_refused_total > refused)  # refused once at least
        first.cancel()
        second.cancel()
        tokens = [t for r in call for c in r.choices for t in c.token_ids]  # then served on a retry
    assert len(tokens) == 4
    t1.join(30)
    t2.join(30)
    reliability.served()


def test_a_request_that_can_never_fit_tells_clients_not_to_retry(tiny_model):
    """Within the model's context but past what this small KV cache can ever hold."""
    small = start_services(tiny_model, target={"kv_cache_tokens": 256})
    try:
        with pytest.raises(grpc.RpcError) as info:
            generate(small.stub, token_ids=[5] * 100, params=pb.SamplingParams(max_tokens=300), timeout=30)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, info.value.details()
        assert dict(info.value.trailing_metadata())[RETRY_PUSHBACK] == "-1"  # gRPC A6: negative, no retry
    finally:
        small.stop()


def test_concurrent_calls_past_the_cap_are_refused(services):
    """max_concurrent_rpcs = 4: four calls held open (health watches, which never end on their
    own), the fifth is refused RESOURCE_EXHAUSTED by gRPC; once they close, calls are served."""
    health = health_pb2_grpc.HealthStub(services.channel)
    watches = [health.Watch(health_pb2.HealthCheckRequest(), timeout=60) for _ in range(4)]
    try:
        for watch in watches:
            next(watch)  # its first status: the call is in flight on the server
        with pytest.raises(grpc.RpcError) as info:
            services.stub.Tokenize(pb.TokenizeRequest(prompt="hi"), timeout=10)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, info.value.details()
        reliability.bad_inputs()
    finally:
        for watch in watches:
            watch.cancel()
    _wait_for(lambda: _tokenize_ok(services))


def _tokenize_ok(services) -> bool:
    try:
        return bool(services.stub.Tokenize(pb.TokenizeRequest(prompt="hi"), timeout=10).token_ids)
    except grpc.RpcError:
        return False  # the cancelled watches may take a moment to leave


def test_a_deadline_that_expires_mid_generation_frees_the_request(services):
    with pytest.raises(grpc.RpcError) as info:
        for _ in services.stub.Generate(pb.GenerateRequest(prompt=TINY_PROMPTS[3], params=LONG), timeout=0.5):
            pass
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    _wait_for(lambda: _stats(services).requests_running == 0 and _stats(services).requests_waiting == 0)
    stats = services.wait_idle()  # and the no_leaks check after the test: pages and sequences back
    assert stats.sequences_live == 0 and stats.kv_pages_free == stats.kv_pages_total
    reliability.faults()
