"""Hostile input through the public API: a catalogue of bad requests, each refused with a status
that names the problem (the wire-level ones sent as raw bytes, as a client in another language
or a broken proxy could send them), requests that race their own cancellation or deadline, and
fuzzed GenerateRequests. Never UNKNOWN or INTERNAL, and the router serves a good request after."""

import math
import random
import threading
import time

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tandem.testing.tiny import TINY_PROMPTS
from tandem.v1 import generate_pb2 as pb
from tests import reliability
from tests.services.harness import generate
from tests.services.protofuzz import call_raw, messages, one_field_changed

INVALID = grpc.StatusCode.INVALID_ARGUMENT
GENERATION = pb.DESCRIPTOR.services_by_name["Generation"]
GENERATE, TOKENIZE = GENERATION.methods_by_name["Generate"], GENERATION.methods_by_name["Tokenize"]
NEVER = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE}
P = pb.SamplingParams
MIB = 1024 * 1024
MARK = "@@@"  # replaced by three bytes of invalid UTF-8 after serializing (same length)


def req(**fields) -> bytes:
    return pb.GenerateRequest(**fields).SerializeToString()


def bad_utf8(message) -> bytes:
    data = message.SerializeToString()
    assert data.count(MARK.encode()) == 1
    return data.replace(MARK.encode(), b"\xc3\x28\xff")


GOOD = dict(prompt="hi", params=P(max_tokens=2))


def floats(field: str):
    """NaN and the infinities in one float field of SamplingParams."""
    return [(f"{field} = {v}", GENERATE, lambda v=v: req(prompt="hi", params=P(**{field: v})), INVALID, f"params.{field}")
            for v in (math.nan, math.inf, -math.inf)]


# (name, method, payload (bytes, built when the case runs), status, a needle of its details)
CASES = [
    # the wire
    ("truncated message", GENERATE, lambda: req(**GOOD)[:-3], INVALID, "cannot parse tandem.v1.GenerateRequest"),
    ("a varint that never ends", GENERATE, lambda: b"\xff" * 12, INVALID, "cannot parse tandem.v1.GenerateRequest"),
    ("random bytes", GENERATE, lambda: bytes.fromhex("a7f3c2d91e0b5a6f8c44e1d2b9"), INVALID, "cannot parse"),
    ("length past the end", GENERATE, lambda: b"\x12\x64abc", INVALID, "cannot parse tandem.v1.GenerateRequest"),
    ("truncated packed token_ids", GENERATE, lambda: b"\x22\x02\x05\x80", INVALID, "cannot parse"),
    ("invalid UTF-8 in prompt", GENERATE, lambda: bad_utf8(pb.GenerateRequest(prompt=MARK)), INVALID, "cannot parse"),
    ("invalid UTF-8 in content", GENERATE,
     lambda: bad_utf8(pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content=MARK)])), INVALID, "cannot parse"),
    ("invalid UTF-8 in role", GENERATE,
     lambda: bad_utf8(pb.GenerateRequest(messages=[pb.ChatMessage(role=MARK, content="hi")])), INVALID, "cannot parse"),
    ("invalid UTF-8 in stop", GENERATE,
     lambda: bad_utf8(pb.GenerateRequest(prompt="hi", params=P(stop=[MARK]))), INVALID, "cannot parse"),
    ("invalid UTF-8 in request_id", GENERATE,
     lambda: bad_utf8(pb.GenerateRequest(request_id=MARK, prompt="hi")), INVALID, "cannot parse"),
    ("invalid UTF-8 to Tokenize", TOKENIZE, lambda: bad_utf8(pb.TokenizeRequest(prompt=MARK)), INVALID,
     "cannot parse tandem.v1.TokenizeRequest"),
    ("truncated Tokenize", TOKENIZE, lambda: pb.TokenizeRequest(prompt="hello").SerializeToString()[:-1], INVALID,
     "/tandem.v1.Generation/Tokenize"),
    ("prompt sent as a varint", GENERATE, lambda: b"\x10\x05", INVALID, "exactly one of"),
    ("only an unknown field", GENERATE, lambda: b"\xf8\x06\x01", INVALID, "exactly one of"),
    # NaN and infinities
    *floats("temperature"), *floats("top_p"), *floats("min_p"), *floats("repetition_penalty"),
    *floats("frequency_penalty"), *floats("presence_penalty"),
    ("logit_bias NaN", GENERATE, lambda: req(prompt="hi", params=P(logit_bias={5: math.nan})), INVALID, "params.logit_bias"),
    ("logit_bias -inf", GENERATE, lambda: req(prompt="hi", params=P(logit_bias={5: -math.inf})), INVALID, "params.logit_bias"),
    ("frequency_penalty 1e30", GENERATE, lambda: req(prompt="hi", params=P(frequency_penalty=1e30)), INVALID,
     "params.frequency_penalty"),
    # sizes
    ("n = 2^32 - 1", GENERATE, lambda: req(prompt="hi", params=P(n=2**32 - 1)), INVALID, "params.n = 4294967295"),
    ("max_tokens = 2^32 - 1", GENERATE, lambda: req(prompt="hi", params=P(max_tokens=2**32 - 1)), INVALID, "params.max_tokens"),
    ("top_logprobs = 2^32 - 1", GENERATE, lambda: req(prompt="hi", params=P(top_logprobs=2**32 - 1)), INVALID,
     "params.top_logprobs = 4294967295: at most 20 (max_top_logprobs)"),
    ("a million logit_bias entries", GENERATE, lambda: req(prompt="hi", params=P(logit_bias=dict.fromkeys(range(10**6), 1.0))),
     INVALID, "params.logit_bias has 1000000 entries: at most 1024 (max_logit_bias)"),
    ("a 60 MiB prompt", GENERATE, lambda: req(prompt="a" * (60 * MIB)), INVALID, "prompt has 62914560 bytes: at most"),
    ("a message past the port's 64 MiB", GENERATE, lambda: req(prompt="a" * (65 * MIB)), grpc.StatusCode.RESOURCE_EXHAUSTED,
     "larger than max"),
    ("a 60 MiB prompt to Tokenize", TOKENIZE, lambda: pb.TokenizeRequest(prompt="é" * (30 * MIB)).SerializeToString(),
     INVALID, "(max_prompt_bytes)"),
    ("messages past the byte cap", GENERATE,
     lambda: req(messages=[pb.ChatMessage(role="user", content="x" * (3 * MIB))] * 2), INVALID,
     "messages hold 6291456 bytes of content"),
    ("a megabyte request id", GENERATE, lambda: req(request_id="r" * MIB, prompt="hi"), INVALID,
     "request_id has 1048576 bytes: at most 256 (max_request_id_bytes)"),
    ("a request id with a newline", GENERATE, lambda: req(request_id="a\nb", prompt="hi"), INVALID, "request_id"),
    ("1025 messages", GENERATE, lambda: req(messages=[pb.ChatMessage(role="user", content="hi")] * 1025), INVALID,
     "messages has 1025 entries: at most 1024 (max_messages)"),
    ("empty role", GENERATE, lambda: req(messages=[pb.ChatMessage(role="", content="hi")]), INVALID, "messages[0].role"),
    ("role tool", GENERATE, lambda: req(messages=[pb.ChatMessage(role="tool", content="hi")]), INVALID, "messages[0].role"),
    ("a megabyte role", GENERATE, lambda: req(messages=[pb.ChatMessage(role="w" * MIB, content="hi")]), INVALID,
     "(1048576 characters)"),
    ("unknown role to Tokenize", TOKENIZE,
     lambda: pb.TokenizeRequest(messages=[pb.ChatMessage(role="root", content="hi")]).SerializeToString(), INVALID,
     "messages[0].role"),
    ("1025 stop token ids", GENERATE, lambda: req(prompt="hi", params=P(stop_token_ids=[1] * 1025)), INVALID,
     "params.stop_token_ids has 1025 entries"),
    ("a megabyte stop string", GENERATE, lambda: req(prompt="hi", params=P(stop=["s" * MIB])), INVALID,
     "params.stop[0] has 1048576 characters"),
    ("a million token ids", GENERATE, lambda: req(token_ids=[5] * 10**6), INVALID, "context"),
    ("token id -2^31", GENERATE, lambda: req(token_ids=[-(2**31)]), INVALID, "token_ids[0]"),
    ("logit_bias id -1", GENERATE, lambda: req(prompt="hi", params=P(logit_bias={-1: 1.0})), INVALID, "params.logit_bias"),
    ("top_k -2^31", GENERATE, lambda: req(prompt="hi", params=P(top_k=-(2**31))), INVALID, "params.top_k"),
    ("prompt and messages", GENERATE, lambda: req(prompt="hi", messages=[pb.ChatMessage(role="user", content="hi")]),
     INVALID, "got prompt, messages"),
]


def serves(services) -> None:
    ok = generate(services.stub, prompt=TINY_PROMPTS[0], params=P(max_tokens=3, temperature=0, ignore_eos=True))
    assert len(ok[0]) == 3


def test_the_catalogue_has_40_cases():
    assert len(CASES) >= 40 and len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize("name,method,payload,code,needle", CASES, ids=[c[0] for c in CASES])
def test_bad_request_gets_a_status_naming_it(services, name, method, payload, code, needle):
    status, details = call_raw(services.channel, method, [payload()], timeout=60)
    reliability.bad_inputs()
    assert status == code, details
    assert needle in details
    assert len(details) < 1000  # a client's megabyte never comes back in the trailers
    serves(services)


def _stream(services, **fields):
    return services.stub.Generate(pb.GenerateRequest(**fields), timeout=30)


def test_streams_cancelled_at_once_and_after_the_first_response(services):
    long = dict(prompt=TINY_PROMPTS[1], params=P(max_tokens=200, ignore_eos=True, n=2))
    for _ in range(5):
        _stream(services, **long).cancel()
        stream = _stream(services, **long)
        next(stream)
        stream.cancel()
        with pytest.raises(grpc.RpcError) as info:
            list(stream)
        assert info.value.code() == grpc.StatusCode.CANCELLED
    reliability.bad_inputs(10)
    serves(services)


def test_requests_racing_their_own_cancellation(services):
    """Cancels land anywhere: before the request is tokenized, queued, prefilled or decoding."""
    rng = random.Random(3)
    delays = [rng.uniform(0, 0.05) for _ in range(16)]

    def race(delay: float) -> None:
        stream = _stream(services, prompt=TINY_PROMPTS[2], params=P(max_tokens=64, ignore_eos=True))
        threading.Timer(delay, stream.cancel).start()
        try:
            list(stream)
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.CANCELLED, e.details()

    threads = [threading.Thread(target=race, args=(d,)) for d in delays]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    reliability.bad_inputs(len(delays))
    serves(services)


def test_a_1ms_deadline(services):
    for _ in range(5):
        with pytest.raises(grpc.RpcError) as info:
            list(services.stub.Generate(pb.GenerateRequest(prompt=TINY_PROMPTS[0], params=P(max_tokens=50)), timeout=0.001))
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    reliability.bad_inputs(5)
    serves(services)


FUZZ = settings(max_examples=60, deadline=None, database=None, suppress_health_check=list(HealthCheck))
# Every field random (nearly all refused), or one field of a valid request that sets most
# parameters (reaching the scheduler and the sampler).
VALID = pb.GenerateRequest(request_id="fuzz", prompt=TINY_PROMPTS[0], params=P(
    max_tokens=4, temperature=0.8, top_p=0.9, top_k=20, min_p=0.01, repetition_penalty=1.1, frequency_penalty=0.1,
    presence_penalty=0.1, logit_bias={5: 2.0}, seed=7, stop=["zz"], stop_token_ids=[3], n=2, logprobs=True,
    top_logprobs=2))
VALID_CHAT = pb.GenerateRequest(messages=[pb.ChatMessage(role="system", content="be brief"),
                                          pb.ChatMessage(role="user", content="hi")], params=P(max_tokens=3))
GENERATE_REQUESTS = st.one_of(messages(pb.GenerateRequest.DESCRIPTOR), one_field_changed(VALID),
                              one_field_changed(VALID_CHAT))


@FUZZ
@given(request=GENERATE_REQUESTS)
def test_fuzzed_generate_requests_never_fail_unknown(services, request):
    status, details = call_raw(services.channel, GENERATE, [request.SerializeToString()], timeout=30)
    reliability.bad_inputs()
    assert status not in NEVER, (status, details, request)


@FUZZ
@given(request=messages(pb.TokenizeRequest.DESCRIPTOR))
def test_fuzzed_tokenize_requests_never_fail_unknown(services, request):
    status, details = call_raw(services.channel, TOKENIZE, [request.SerializeToString()], timeout=30)
    reliability.bad_inputs()
    assert status not in NEVER, (status, details, request)


def test_served_after_the_fuzzing(services):
    serves(services)
