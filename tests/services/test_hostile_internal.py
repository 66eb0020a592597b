"""Hostile input to every service, the internal ones included: random bytes sent raw to every
method, request streams that turn undecodable midway, and fuzzed steps and drafts. Each fails its
own call with a status naming the problem (never UNKNOWN or INTERNAL); no service dies, and none
is poisoned: after a reset, which a restarted router would send, a request's greedy output is
what it was before."""

import random
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tandem.testing.tiny import TINY_PROMPTS
from tandem.v1 import engine_pb2 as epb
from tandem.v1 import generate_pb2 as pb
from tests import reliability
from tests.services.harness import generate, start_services
from tests.services.protofuzz import call_raw, messages, methods, one_field_changed

# UNAVAILABLE is a fair answer from a model service: a draft call for a target step whose hidden
# states never come (the fuzz asks for steps that never ran) waits for them, then gives up.
NEVER = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL}
INVALID = grpc.StatusCode.INVALID_ARGUMENT
HEALTH = health_pb2.DESCRIPTOR.services_by_name["Health"]
REFLECTION = reflection_pb2.DESCRIPTOR.services_by_name["ServerReflection"]
TARGET = epb.DESCRIPTOR.services_by_name["TargetEngine"]
DRAFT = epb.DESCRIPTOR.services_by_name["DraftEngine"]
GENERATION = pb.DESCRIPTOR.services_by_name["Generation"]
GREEDY = pb.SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def trio(tiny_model, tmp_path_factory):
    """Router, target and a draft; no prefix cache, so that an idle router holds no sequence
    that a reset would take from under it; drafts wait a second for hidden states that never
    come, not ten."""
    from tandem.models.eagle_io import random_eagle_checkpoint

    head = random_eagle_checkpoint(tmp_path_factory.mktemp("head") / "eagle", tiny_model, seed=1)
    s = start_services(tiny_model, draft_model=head, draft={"hidden_timeout_s": 1.0},
                       router={"spec_draft_length": 3, "prefix_cache_max_num_recycling_seqs": 0})
    s.reference = [generate(s.stub, prompt=p, params=GREEDY)[0] for p in TINY_PROMPTS[:2]]
    yield s
    reliability.served_by(s.stub)
    s.stop()


def ports(s) -> dict[str, tuple[int, list]]:
    return {"router": (s.router_port, [GENERATION, HEALTH, REFLECTION]),
            "target": (s.target_port, [TARGET, HEALTH, REFLECTION]),
            "draft": (s.draft_port, [DRAFT, HEALTH, REFLECTION])}


def reset_models(s) -> None:
    """What a router that starts sends the target and the draft."""
    for port, service in ((s.target_port, TARGET), (s.draft_port, DRAFT)):
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            status, details = call_raw(ch, service.methods_by_name["Reset"], [b""])
            assert status == grpc.StatusCode.OK, details


def wait_serving(port: int, timeout: float = 20.0) -> int:
    """The service's health once SERVING, or when `timeout` runs out. A caller that opened the
    target's Peer stream took it from the draft (the newest peer wins: a draft that restarts
    reconnects so), and the draft is NOT_SERVING until its own stream is back."""
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        while True:
            status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10).status
            if status == health_pb2.HealthCheckResponse.SERVING or time.monotonic() > deadline:
                return status
            time.sleep(0.1)


def assert_alive_and_unpoisoned(s) -> None:
    for name, (port, _) in ports(s).items():
        assert wait_serving(port) == health_pb2.HealthCheckResponse.SERVING, name
    reset_models(s)
    assert [generate(s.stub, prompt=p, params=GREEDY)[0] for p in TINY_PROMPTS[:2]] == s.reference
    stats = s.wait_idle()
    assert stats.sequences_live == 0 and stats.kv_pages_free == stats.kv_pages_total, stats


def test_random_bytes_to_every_method_of_every_service(trio):
    rng = random.Random(11)
    tried = 0
    for name, (port, services) in ports(trio).items():
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            for method in methods(*services):
                for _ in range(8):
                    payloads = [rng.randbytes(rng.randrange(1, 48)) for _ in range(rng.choice((1, 2)))]
                    status, details = call_raw(ch, method, payloads, timeout=5, responses=1)
                    tried += 1
                    assert status not in NEVER, (name, method.full_name, payloads, status, details)
    reliability.bad_inputs(tried)
    assert_alive_and_unpoisoned(trio)


def test_health_watch_on_every_service(trio):
    """grpc's aio Health.Watch streams with context.write: the router's interceptor awaits it."""
    for name, (port, _) in ports(trio).items():
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            watch = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(), timeout=10)
            assert next(watch).status == health_pb2.HealthCheckResponse.SERVING, name
            watch.cancel()


def test_health_watch_behind_the_api_key_guard(tiny_model, tmp_path):
    """The guard interceptor iterates the stream it wraps: the one inside it must be one."""
    (tmp_path / "keys").write_text("key-1\n")
    s = start_services(tiny_model, router={"api_key_file": tmp_path / "keys"})
    try:
        with grpc.insecure_channel(f"127.0.0.1:{s.router_port}") as ch:
            watch = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(), timeout=10)
            assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
            watch.cancel()
            status, details = call_raw(ch, GENERATION.methods_by_name["Generate"], [b"\xff"])
        reliability.bad_inputs()
        assert status == grpc.StatusCode.UNAUTHENTICATED, details  # no parse errors for a caller without a key
    finally:
        s.stop()


# The first message of each stream decodes, the second does not: the call ends INVALID_ARGUMENT.
STREAMS = [
    ("target", TARGET.methods_by_name["Steps"], epb.StepRequest(step_id=0)),
    ("target", TARGET.methods_by_name["Peer"], epb.DraftToTarget()),
    ("draft", DRAFT.methods_by_name["Drafts"], epb.DraftRequest()),
    ("router", REFLECTION.methods_by_name["ServerReflectionInfo"], reflection_pb2.ServerReflectionRequest(list_services="")),
    ("target", REFLECTION.methods_by_name["ServerReflectionInfo"], reflection_pb2.ServerReflectionRequest(list_services="")),
]


@pytest.mark.parametrize("service,method,first", STREAMS, ids=[f"{s[0]}-{s[1].name}" for s in STREAMS])
def test_a_stream_that_turns_undecodable_ends_invalid_argument(trio, service, method, first):
    port = ports(trio)[service][0]
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        status, details = call_raw(ch, method, [first.SerializeToString(), b"\x0a\x05ab"], timeout=10, responses=100)
    reliability.bad_inputs()
    assert status == INVALID, details
    assert f"cannot parse {method.input_type.full_name}" in details and method.name in details
    assert_alive_and_unpoisoned(trio)


SAMPLER = epb.SamplerConfig(temperature=0.7, top_p=0.9, top_k=10, repetition_penalty=1.1, logit_bias={3: 1.0},
                            seed=4, logprobs=True, top_logprobs=2)
VALID_STEP = epb.StepRequest(
    step_id=1,
    ops=[epb.SequenceOp(add=epb.AddSequence(seq_id=1, sampler=SAMPLER, num_prompt_tokens=3)),
         epb.SequenceOp(add=epb.AddSequence(seq_id=2, sampler=SAMPLER))],
    entries=[epb.StepEntry(seq_id=1, token_ids=[5, 6, 7], sample=True, emit_hidden=True),
             epb.StepEntry(seq_id=2, token_ids=[8, 9], sample=False)],
)
# Valid after VALID_STEP: mutated, each meets live sequences and a target that can run it.
VALID_ADD = epb.StepRequest(
    step_id=2,
    ops=[epb.SequenceOp(add=epb.AddSequence(seq_id=11, sampler=SAMPLER, num_prompt_tokens=2))],
    entries=[epb.StepEntry(seq_id=11, token_ids=[5, 6, 7, 8], sample=True, emit_hidden=True),
             epb.StepEntry(seq_id=2, token_ids=[10], sample=True)],
)
VALID_DECODE = epb.StepRequest(
    step_id=2,
    ops=[epb.SequenceOp(fork=epb.ForkSequence(seq_id=3, parent_id=1, position=2, sampler=SAMPLER)),
         epb.SequenceOp(pop=epb.PopTokens(seq_id=2, count=1))],
    entries=[epb.StepEntry(seq_id=1, kind=epb.StepEntry.DECODE, token_ids=[4, 10, 11], sample=True,
                           num_draft_tokens=2, tree_parents=[0, 0], emit_hidden=True)],
    draft_step_id=1,
)
STEPS = st.lists(st.one_of(messages(epb.StepRequest.DESCRIPTOR), one_field_changed(VALID_ADD),
                           one_field_changed(VALID_DECODE)), min_size=1, max_size=3)
FUZZ = settings(max_examples=40, deadline=None, database=None, suppress_health_check=list(HealthCheck))


@FUZZ
@given(steps=STEPS)
def test_fuzzed_steps_fail_their_call_not_the_target(trio, steps):
    """A few steps in a row from a clean target, after a valid one, so that the fuzzed ones
    meet live sequences."""
    reset_models(trio)
    with grpc.insecure_channel(f"127.0.0.1:{trio.target_port}") as ch:
        for step in [VALID_STEP, *steps]:
            status, details = call_raw(ch, TARGET.methods_by_name["Step"], [step.SerializeToString()], timeout=30)
            reliability.bad_inputs()
            assert status not in NEVER, (status, details, step)


VALID_DRAFT = epb.DraftRequest(
    draft_step_id=1, after_target_step=0,
    ops=[epb.SequenceOp(add=epb.AddSequence(seq_id=1, sampler=SAMPLER))],
    seqs=[epb.DraftSeq(seq_id=1, num_tokens=3)],
)
VALID_DRAFT_ADD = epb.DraftRequest(
    draft_step_id=2, ops=[epb.SequenceOp(add=epb.AddSequence(seq_id=11, sampler=SAMPLER))],
    seqs=[epb.DraftSeq(seq_id=1, num_tokens=2), epb.DraftSeq(seq_id=11, num_tokens=3)],
)
DRAFTS = st.lists(st.one_of(messages(epb.DraftRequest.DESCRIPTOR), one_field_changed(VALID_DRAFT_ADD)),
                  min_size=1, max_size=3)


@FUZZ
@given(drafts=DRAFTS)
def test_fuzzed_drafts_fail_their_call_not_the_draft(trio, drafts):
    reset_models(trio)
    with grpc.insecure_channel(f"127.0.0.1:{trio.draft_port}") as ch:
        for draft in [VALID_DRAFT, *drafts]:
            status, details = call_raw(ch, DRAFT.methods_by_name["Draft"], [draft.SerializeToString()], timeout=30)
            reliability.bad_inputs()
            assert status not in NEVER, (status, details, draft)


def test_alive_and_unpoisoned_after_the_fuzzing(trio):
    assert_alive_and_unpoisoned(trio)
