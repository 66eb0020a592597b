"""Every refusal of the OpenAI-compatible HTTP API, through the official client: OpenAI's error
object with the right status (400 naming the parameter, 401, 404, 413, 429 with Retry-After,
503 while the target is down or the router drains), before any stream commits."""

import threading
import time

import httpx2
import openai
import pytest

from router.figures import snapshot
from router.limits import RequestLimits
from tandem.testing.tiny import TINY_PROMPTS
from tests import reliability
from tests.services.test_openai_api import CHAT, GREEDY, http_services, openai_client

KEY = "sk-tandem-http-test"
PROMPT_BYTES = 2048


@pytest.fixture(scope="module")
def services(tiny_model, tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text(f"{KEY}\n")
    s = http_services(tiny_model, api_key_file=keys, max_waiting=1, max_running_requests=1,
                      request_limits=RequestLimits(max_prompt_bytes=PROMPT_BYTES))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(services):
    with openai_client(services, KEY) as c:
        yield c


def _refused(call, error=openai.APIStatusError):
    with pytest.raises(error) as info:
        call()
    reliability.bad_inputs()
    return info.value


def test_a_missing_or_wrong_key_is_401_and_health_is_open(services):
    with openai_client(services, "sk-wrong") as c:
        error = _refused(lambda: c.models.list(), openai.AuthenticationError)
    assert error.status_code == 401 and error.body["code"] == "invalid_api_key"
    missing = httpx2.post(f"{services.base_url}/chat/completions", json={"messages": CHAT}, timeout=10)
    assert missing.status_code == 401 and "Authorization: Bearer" in missing.json()["error"]["message"]
    assert httpx2.get(services.base_url.removesuffix("/v1") + "/health", timeout=10).status_code == 200


def test_an_unknown_model_is_404(client):
    error = _refused(lambda: client.chat.completions.create(model="gpt-4o", messages=CHAT), openai.NotFoundError)
    assert error.body["param"] == "model" and error.body["code"] == "model_not_found"
    assert error.body["type"] == "invalid_request_error" and "gpt-4o" in error.body["message"]


CHAT_400 = [
    ("temperature", {"temperature": -1}),
    ("top_p", {"top_p": 0}),
    ("n", {"n": 0}),
    ("max_completion_tokens", {"max_completion_tokens": 0}),
    ("max_tokens", {"max_tokens": -5}),
    ("top_logprobs", {"logprobs": True, "top_logprobs": 30}),
    ("top_logprobs", {"top_logprobs": 2}),  # without logprobs
    ("stop", {"stop": ["x"] * 33}),
    ("logit_bias", {"logit_bias": {"99999999": 1.0}}),
    ("seed", {"seed": -1}),
    ("tools", {"tools": [{"type": "function", "function": {"name": "f"}}]}),
    ("response_format", {"response_format": {"type": "xml"}}),
    ("response_format", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}}}),  # does not compile
    ("stream_options", {"stream_options": {"include_usage": True}}),  # without stream
    ("frobnicate", {"extra_body": {"frobnicate": 1}}),
    ("repetition_penalty", {"extra_body": {"repetition_penalty": 0}}),
    ("messages", {"messages": [{"role": "robot", "content": "hi"}]}),
    ("messages", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}),
]


@pytest.mark.parametrize("param, fields", CHAT_400, ids=[f"{p}-{i}" for i, (p, _) in enumerate(CHAT_400)])
def test_a_bad_chat_request_is_400_naming_the_parameter(client, services, param, fields):
    fields = {"messages": CHAT, "max_tokens": 4, **fields}
    error = _refused(lambda: client.chat.completions.create(model=services.model_name, **fields),
                     openai.BadRequestError)
    assert error.body["param"] == param, error.body
    assert error.body["type"] == "invalid_request_error" and "params." not in error.body["message"]


COMPLETION_400 = [
    ("logprobs", {"logprobs": 30}),
    ("prompt", {"prompt": ["one", "two"]}),
    ("prompt", {"prompt": [5] * 600}),  # past the tiny model's context of 512
    ("echo", {"echo": True}),
]


@pytest.mark.parametrize("param, fields", COMPLETION_400, ids=[f"{p}-{i}" for i, (p, _) in enumerate(COMPLETION_400)])
def test_a_bad_completion_request_is_400_naming_the_parameter(client, services, param, fields):
    fields = {"prompt": TINY_PROMPTS[0], "max_tokens": 4, **fields}
    error = _refused(lambda: client.completions.create(model=services.model_name, **fields), openai.BadRequestError)
    assert error.body["param"] == param, error.body


def test_the_context_length_error_says_so(client, services):
    error = _refused(lambda: client.completions.create(model=services.model_name, prompt=[5] * 600, max_tokens=4))
    assert error.body["code"] == "context_length_exceeded"


def test_a_body_that_is_not_json_is_400(services):
    response = httpx2.post(f"{services.base_url}/chat/completions", content=b"{not json",
                           headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
    assert response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error"


def test_a_prompt_past_the_size_cap_is_413(client, services):
    for stream in (False, True):
        error = _refused(lambda: client.completions.create(model=services.model_name, prompt="a" * (PROMPT_BYTES + 1),
                                                           max_tokens=4, stream=stream))
        assert error.status_code == 413 and error.body["param"] == "prompt", error.body
        assert "max_prompt_bytes" in error.body["message"]


def test_a_full_queue_is_429_with_retry_after_before_the_stream_commits(client, services):
    """max_running_requests 1 and max_waiting 1: one runs, one waits, the third is refused."""
    engine = services.router_engine
    running = client.chat.completions.create(model=services.model_name, messages=CHAT, max_tokens=400, stream=True,
                                             **GREEDY)
    waited = {}

    def second():
        reply = client.chat.completions.create(model=services.model_name, messages=CHAT, max_tokens=4, **GREEDY)
        waited["tokens"] = reply.usage.completion_tokens

    thread = threading.Thread(target=second, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while snapshot(engine).requests_waiting < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    for stream in (False, True):
        error = _refused(lambda: client.chat.completions.create(model=services.model_name, messages=CHAT, max_tokens=4,
                                                                stream=stream), openai.RateLimitError)
        assert error.body["code"] == "rate_limit_exceeded" and "max_waiting" in error.body["message"]
        assert 1 <= int(error.response.headers["retry-after"]) <= 60
        assert 100 <= int(error.response.headers["retry-after-ms"]) <= 60_000
    running.close()  # a disconnect: the waiting request is admitted
    thread.join(60)
    assert waited == {"tokens": 4}


def test_503_while_the_target_is_down_and_while_draining(tiny_model):
    s = http_services(tiny_model)
    health = s.base_url.removesuffix("/v1") + "/health"
    try:
        with openai_client(s) as client:
            s.target_server.stop(0).wait()
            deadline = time.monotonic() + 30
            while httpx2.get(health, timeout=10).status_code == 200 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert httpx2.get(health, timeout=10).json() == {"status": "not serving"}
            error = _refused(lambda: client.chat.completions.create(model=s.model_name, messages=CHAT, max_tokens=4),
                             openai.InternalServerError)
            assert error.status_code == 503 and error.body["type"] == "server_error"
            s.loop.call_soon_threadsafe(s.router_engine.begin_drain)
            deadline = time.monotonic() + 10
            while httpx2.get(health, timeout=10).json() != {"status": "draining"} and time.monotonic() < deadline:
                time.sleep(0.05)
            assert httpx2.get(health, timeout=10).status_code == 503
    finally:
        s.stop()


class _Health:
    """The gRPC health servicer's part drain() uses (the harness keeps no handle on it)."""

    async def enter_graceful_shutdown(self):
        pass


def test_a_drain_ends_a_live_stream_cancelled_then_closes_the_port(tiny_model):
    """SIGTERM's drain(): new requests 503 while the running one has the grace period; past it,
    the stream ends with a "cancelled" chunk and [DONE], not a broken connection."""
    import asyncio

    from router.server import drain

    s = http_services(tiny_model)
    try:
        with openai_client(s) as client:
            stream = client.chat.completions.create(model=s.model_name, messages=CHAT, max_tokens=400, stream=True,
                                                    **GREEDY)
            next(iter(stream))
            drained = asyncio.run_coroutine_threadsafe(drain(s.router_server, s.router_engine, _Health(), 1.5), s.loop)
            time.sleep(0.2)
            error = _refused(lambda: client.chat.completions.create(model=s.model_name, messages=CHAT, max_tokens=4))
            assert error.status_code == 503
            reasons = [c.choices[0].finish_reason for c in stream if c.choices]
            assert reasons[-1] == "cancelled"
            drained.result(timeout=30)
        with pytest.raises(httpx2.ConnectError):
            httpx2.get(s.base_url.removesuffix("/v1") + "/health", timeout=5)
    finally:
        s.stop()
