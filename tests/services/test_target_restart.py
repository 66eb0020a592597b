"""A target service that restarts with other limits, or another model, than the router started
with: the router schedules against the new limits, and refuses to serve another model (its
tokenizer is the router's) until the router's model is back."""

import shutil
from dataclasses import replace

import grpc
import pytest

from target_service.config import TargetConfig
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


def restart_target(s, **fields) -> None:
    """A fresh target process on the same port, with `fields` changed."""
    s.target_server.stop(0).wait()
    config = TargetConfig(model_dir=s.router_engine.config.model_dir, port=s.target_port,
                          kv_cache_tokens=8192, kv_page_size=8)
    s.target_server, _, _, s.target_engine, _ = start_target(replace(config, **fields))


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
    counters = s.router_engine.counters
    assert counters.step_errors_total == 0 and counters.kv_mirror_mismatches == 0


def test_a_target_back_with_another_model_is_refused_until_the_routers_model_is_back(own_services, tmp_path):
    s = own_services
    expected = generate(s.stub, prompt="hello", params=GREEDY)[0]
    other = build_tiny_model(tmp_path / "other", seed=1, hidden_size=32)
    restart_target(s, model_dir=other)
    for _ in range(2):
        with pytest.raises(grpc.RpcError) as e:
            generate(s.stub, prompt="hello", params=GREEDY)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "another model" in e.value.details() and "hidden_size 32, was 64" in e.value.details()
    assert s.target_engine.stats().steps_total == 0  # nothing reached it
    restart_target(s)
    assert generate(s.stub, prompt="hello", params=GREEDY)[0] == expected
    assert s.router_engine.counters.target_restarts == 2
