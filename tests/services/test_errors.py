"""Bad input gets a clear status naming the problem; the services keep answering."""

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from tandem.testing.tiny import TINY_PROMPTS
from tandem.v1 import engine_pb2 as epb
from tandem.v1 import engine_pb2_grpc
from tandem.v1 import generate_pb2 as pb
from tests import reliability
from tests.services.harness import generate, peer_stream

INVALID = grpc.StatusCode.INVALID_ARGUMENT
P = pb.SamplingParams
CASES = [
    ("empty prompt", dict(prompt=""), INVALID, "exactly one of prompt, messages, token_ids"),
    ("two inputs", dict(prompt="hi", token_ids=[5, 6]), INVALID, "got prompt, token_ids"),
    ("unknown role", dict(messages=[pb.ChatMessage(role="wizard", content="hi")]), INVALID, "messages[0].role"),
    ("temperature < 0", dict(prompt="hi", params=P(temperature=-0.5)), INVALID, "params.temperature"),
    ("top_p = 0", dict(prompt="hi", params=P(top_p=0.0)), INVALID, "params.top_p"),
    ("top_p > 1", dict(prompt="hi", params=P(top_p=1.5)), INVALID, "params.top_p"),
    ("top_k < 0", dict(prompt="hi", params=P(top_k=-1)), INVALID, "params.top_k"),
    ("min_p > 1", dict(prompt="hi", params=P(min_p=2.0)), INVALID, "params.min_p"),
    ("repetition_penalty 0", dict(prompt="hi", params=P(repetition_penalty=0.0)), INVALID, "params.repetition_penalty"),
    ("frequency_penalty", dict(prompt="hi", params=P(frequency_penalty=3.0)), INVALID, "params.frequency_penalty"),
    ("top_logprobs", dict(prompt="hi", params=P(top_logprobs=21)), INVALID, "params.top_logprobs"),
    ("logit_bias id", dict(prompt="hi", params=P(logit_bias={99999: 1.0})), INVALID, "params.logit_bias"),
    ("max_tokens 0", dict(prompt="hi", params=P(max_tokens=0)), INVALID, "params.max_tokens"),
    ("max_tokens beyond context", dict(prompt="hi", params=P(max_tokens=100000)), INVALID, "params.max_tokens"),
    ("n = 0", dict(prompt="hi", params=P(n=0)), INVALID, "params.n"),
    ("n = 65", dict(prompt="hi", params=P(n=65)), INVALID, "params.n"),
    ("empty stop string", dict(prompt="hi", params=P(stop=["x", ""])), INVALID, "params.stop[1]"),
    ("stop token id", dict(prompt="hi", params=P(stop_token_ids=[-3])), INVALID, "params.stop_token_ids[0]"),
    ("33 stop strings", dict(prompt="hi", params=P(stop=[f"s{i}" for i in range(33)])), INVALID, "params.stop has 33"),
    ("long stop string", dict(prompt="hi", params=P(stop=["x", "y" * 1025])), INVALID, "params.stop[1] has 1025"),
    ("token id outside vocab", dict(token_ids=[5, 448]), INVALID, "token_ids[1]"),
    ("negative token id", dict(token_ids=[-1]), INVALID, "token_ids[0]"),
    ("prompt beyond context", dict(token_ids=[5] * 600), INVALID, "context"),
]


@pytest.mark.parametrize("name,fields,code,needle", CASES, ids=[c[0] for c in CASES])
def test_bad_request_gets_clear_status(services, name, fields, code, needle):
    with pytest.raises(grpc.RpcError) as info:
        generate(services.stub, timeout=30, **fields)
    reliability.bad_inputs()
    assert info.value.code() == code, info.value.details()
    assert needle in info.value.details()
    # the service still answers
    ok = generate(services.stub, prompt=TINY_PROMPTS[0], params=P(max_tokens=3, temperature=0, ignore_eos=True))
    assert len(ok[0]) == 3


def test_a_valid_extreme_is_served(services):
    """A repetition penalty that overflows seen logits to +inf is served (a NaN row used to fail
    the whole step, every request in it), and the next request is too."""
    params = P(repetition_penalty=1e-45, max_tokens=6, temperature=1.0, seed=5, ignore_eos=True)
    assert len(generate(services.stub, prompt=TINY_PROMPTS[1], params=params)[0]) == 6
    ok = generate(services.stub, prompt=TINY_PROMPTS[0], params=P(max_tokens=3, temperature=0, ignore_eos=True))
    assert len(ok[0]) == 3


def test_request_larger_than_the_kv_cache_is_resource_exhausted(tiny_model):
    from tests.services.harness import start_services

    small = start_services(tiny_model, target={"kv_cache_tokens": 64, "kv_page_size": 8})
    try:
        with pytest.raises(grpc.RpcError) as info:
            generate(small.stub, prompt="hi", params=P(max_tokens=100, ignore_eos=True))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "KV pages" in info.value.details()
        assert len(generate(small.stub, prompt="hi", params=P(max_tokens=8, ignore_eos=True))[0]) == 8
    finally:
        small.stop()


def test_target_rejects_bad_steps_and_keeps_state(services):
    with grpc.insecure_channel(f"127.0.0.1:{services.target_port}") as ch:
        target = engine_pb2_grpc.TargetEngineStub(ch)
        unknown = epb.StepRequest(entries=[epb.StepEntry(seq_id=987654, token_ids=[1], sample=True)])
        with pytest.raises(grpc.RpcError) as info:
            target.Step(unknown, timeout=10)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND and "987654" in info.value.details()
        sampler = epb.SamplerConfig(top_p=1.0, repetition_penalty=1.0)
        bad_fork = epb.StepRequest(ops=[epb.SequenceOp(fork=epb.ForkSequence(seq_id=5, parent_id=404, sampler=sampler))])
        with pytest.raises(grpc.RpcError) as info:
            target.Step(bad_fork, timeout=10)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        no_op = epb.StepRequest(ops=[epb.SequenceOp()])
        with pytest.raises(grpc.RpcError) as info:
            target.Step(no_op, timeout=10)
        assert info.value.code() == INVALID
        reliability.bad_inputs(3)
    assert generate(services.stub, prompt="hi", params=P(max_tokens=2, ignore_eos=True))[0]


def test_malformed_draft_probabilities_are_dropped_and_the_peer_stream_stays_up(tiny_model):
    """Rows that do not fit their shape, or another vocabulary than the target's: that draft step
    gets none (its step verifies as top-k at once, no wait for rows), and the next message on the
    same stream is read."""
    import torch

    from tandem import peer_codec
    from tandem.peer import DraftProbs
    from target_service.config import TargetConfig
    from target_service.server import start_target

    server, _, port, engine, _ = start_target(TargetConfig(model_dir=tiny_model, port=0, kv_cache_tokens=256, kv_page_size=8))
    rows = torch.zeros(3, engine.model.config.vocab_size, dtype=torch.float16)
    rows[0] = 0.002  # one row of three: sent row-sparse
    bad = peer_codec.draft_probs_to_pb(DraftProbs(5, {1: rows}))
    bad.seqs[0].rows[0] = 7  # past the 3 rows
    other_vocab = peer_codec.draft_probs_to_pb(DraftProbs(6, {1: rows[:, :50]}))
    try:
        with peer_stream(port, [bad, other_vocab, peer_codec.draft_probs_to_pb(DraftProbs(7, {1: rows}))]):
            assert engine.peer.take_probs(5, timeout=10) == {} and engine.peer.take_probs(6, timeout=10) == {}
            assert torch.equal(engine.peer.take_probs(7, timeout=10)[1], rows)
        reliability.bad_inputs(2)
    finally:
        server.stop(0)


def test_health_and_reflection_on_both_services(services):
    for port, service in ((services.router_port, "tandem.v1.Generation"), (services.target_port, "tandem.v1.TargetEngine")):
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            for name in ("", service):
                status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
                assert status.status == health_pb2.HealthCheckResponse.SERVING
            stub = reflection_pb2_grpc.ServerReflectionStub(ch)
            replies = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5)
            names = {s.name for r in replies for s in r.list_services_response.service}
            assert service in names and "grpc.health.v1.Health" in names
