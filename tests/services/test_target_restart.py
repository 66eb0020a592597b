"""A target service that restarts with other limits, or another model, than the router started
with: the router schedules against the new limits, and refuses to serve another model (its
tokenizer is the router's) until the router's model is back."""

import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import grpc
import pytest

from grpc_health.v1 import health_pb2, health_pb2_grpc

from router.figures import snapshot
from target_service.config import TargetConfig
from target_service.engine import TargetEngine
from target_service.server import start_target
from tandem.testing.tiny import build_tiny_model
from tandem.v1 import generate_pb2 as pb
from tests.services.harness import generate, start_services

GREEDY = pb.SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture
def own_services(tiny_model):
    s = start_services(tiny_model, router={"step_timeout_s": 2.0})
    yield s
    s.stop()


def restart_target(s, stop: bool = True, **fields) -> None:
    """A fresh target process on the same port, with `fields` changed; its engine is built first,
    so the port is closed only for as long as a server takes to bind it."""
    config = TargetConfig(model_dir=s.router_engine.config.model_dir, port=s.target_port,
                          kv_cache_tokens=8192, kv_page_size=8)
    engine = TargetEngine(replace(config, **fields))
    if stop:
        s.target_server.stop(0).wait()
    s.target_server, _, _, s.target_engine, _ = start_target(replace(config, **fields), engine)


def router_health(s) -> int:
    return health_pb2_grpc.HealthStub(s.channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status


def wait_for_health(s, status: int) -> None:
    """The router finds a change on its own (its step stream ends, or it asks the target again
    every second while it cannot serve): no request goes to it meanwhile."""
    _wait_for(lambda: router_health(s) == status)


def test_a_target_back_with_a_smaller_kv_cache_is_scheduled_against_it(own_services, tmp_path):
    s = own_services
    expected = generate(s.stub, prompt="hello", params=GREEDY)[0]
    renamed = tmp_path / "bfloat16"  # the same model from another folder (ours: float32 / bfloat16)
    shutil.copytree(s.router_engine.config.model_dir, renamed)
    restart_target(s, kv_cache_tokens=256, model_dir=renamed)
    assert generate(s.stub, prompt="hello", params=GREEDY)[0] == expected
    assert s.router_engine.limits.kv_pages_total == 256 // 8
    assert s.router_engine.limits.max_total_sequence_length == 256
    long = pb.SamplingParams(temperature=0, max_tokens=300, ignore_eos=True)  # fit 8,192 tokens, not 256
    with pytest.raises(grpc.RpcError) as e:
        generate(s.stub, prompt="hello", params=long)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "can never fit" in e.value.details()
    counters = s.router_engine.figures
    assert counters.step_errors_total == 0 and counters.kv_mirror_mismatches == 0


def test_a_target_back_with_another_model_is_refused_until_the_routers_model_is_back(own_services, tmp_path):
    s = own_services
    expected = generate(s.stub, prompt="hello", params=GREEDY)[0]
    other = build_tiny_model(tmp_path / "other", seed=1, hidden_size=32)
    restart_target(s, model_dir=other)
    wait_for_health(s, health_pb2.HealthCheckResponse.NOT_SERVING)
    for _ in range(2):
        with pytest.raises(grpc.RpcError) as e:
            generate(s.stub, prompt="hello", params=GREEDY)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "another model" in e.value.details() and "hidden_size 32, was 64" in e.value.details()
    assert s.target_engine.stats().steps_total == 0  # nothing reached it
    restart_target(s)
    wait_for_health(s, health_pb2.HealthCheckResponse.SERVING)
    assert generate(s.stub, prompt="hello", params=GREEDY)[0] == expected
    assert s.router_engine.figures.target_restarts == 2


def test_router_health_follows_a_target_that_goes_down_before_any_request(own_services):
    s = own_services
    assert router_health(s) == health_pb2.HealthCheckResponse.SERVING
    s.target_server.stop(0).wait()
    wait_for_health(s, health_pb2.HealthCheckResponse.NOT_SERVING)
    with pytest.raises(grpc.RpcError) as e:
        generate(s.stub, prompt="hello", params=GREEDY)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    restart_target(s, stop=False)
    wait_for_health(s, health_pb2.HealthCheckResponse.SERVING)
    assert s.router_engine.figures.target_restarts == 1  # found with no request after its return
    assert len(generate(s.stub, prompt="hello", params=GREEDY)[0]) == GREEDY.max_tokens


def test_requests_waiting_through_a_restart_fail_only_if_they_can_never_fit_the_target_that_came_back(tmp_path):
    """The running request fails with the target; of those waiting (one sequence at a time),
    the one the smaller KV cache can never hold fails RESOURCE_EXHAUSTED, the other is served."""
    model = build_tiny_model(tmp_path / "model", max_position_embeddings=4096)
    s = start_services(model, router={"step_timeout_s": 2.0, "max_num_sequence": 1})
    try:
        expected = generate(s.stub, prompt="hello", params=GREEDY)[0]
        long = pb.SamplingParams(temperature=0, max_tokens=4000, ignore_eos=True)  # still running at the restart
        too_long = pb.SamplingParams(temperature=0, max_tokens=300, ignore_eos=True)  # fits 8,192 tokens, not 256
        with ThreadPoolExecutor(3) as pool:
            running = pool.submit(generate, s.stub, prompt="hello", params=long)
            _wait_for(lambda: snapshot(s.router_engine).requests_running == 1)
            never_fits = pool.submit(generate, s.stub, prompt="hello", params=too_long)
            fits = pool.submit(generate, s.stub, prompt="hello", params=GREEDY)
            _wait_for(lambda: snapshot(s.router_engine).requests_waiting == 2)
            restart_target(s, kv_cache_tokens=256)
            assert _code(running) == grpc.StatusCode.UNAVAILABLE
            assert _code(never_fits) == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "since the target service restarted" in never_fits.exception().details()
            assert fits.result()[0] == expected
        assert s.router_engine.limits.kv_pages_total == 256 // 8
    finally:
        s.stop()


def _wait_for(condition, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def _code(future) -> grpc.StatusCode:
    error = future.exception(timeout=60)
    assert isinstance(error, grpc.RpcError), f"expected an error, got {future.result()}"
    return error.code()
