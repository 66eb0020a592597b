"""The router's OpenAI-compatible HTTP API through the official `openai` client and raw
server-sent events, against a real target and router on loopback: chat and completions, whole
and streamed, n = 2, logprobs in both formats, stop strings and ids, seeds, usage, the same greedy
text as gRPC, and a client that disconnects freeing its request."""

import json
import time

import httpx2
import openai
import pytest

from router.figures import snapshot
from tandem.bench.services import free_port
from tandem.testing.tiny import TINY_PROMPTS
from tandem.v1 import generate_pb2 as pb
from tests import reliability
from tests.services.harness import generate, start_services

CHAT = [{"role": "user", "content": TINY_PROMPTS[0]}]
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}  # exactly max_tokens, always


def http_services(model, **router):
    """A target and a router serving HTTP on a free port (`base_url`, `model_name` set)."""
    port = free_port()
    s = start_services(model, router={"http_port": port, **router})
    s.base_url = f"http://127.0.0.1:{port}/v1"
    s.model_name = s.router_server.http.model_name
    return s


def openai_client(services, key: str = "unused") -> openai.OpenAI:
    """No retries: a refusal must show as the test's own error."""
    return openai.OpenAI(base_url=services.base_url, api_key=key, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def services(tiny_model):
    s = http_services(tiny_model)
    yield s
    reliability.served_by(s.stub)
    s.stop()


@pytest.fixture(scope="module")
def client(services):
    with openai_client(services) as c:
        yield c


def _chat(client, services, **kw):
    return client.chat.completions.create(model=services.model_name, messages=kw.pop("messages", CHAT), **kw)


def test_models_and_health(client, services):
    models = client.models.list().data
    assert [m.id for m in models] == [services.model_name] and models[0].owned_by == "tandem"
    assert client.models.retrieve(services.model_name).id == services.model_name
    health = httpx2.get(services.base_url.removesuffix("/v1") + "/health", timeout=10)
    assert health.status_code == 200 and health.json() == {"status": "serving"}


def test_greedy_chat_and_completion_equal_grpc(client, services):
    """The same request over HTTP and over gRPC: the same text, the same token count."""
    params = pb.SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    _, grpc_chat, _, last = generate(services.stub, messages=[pb.ChatMessage(**m) for m in CHAT], params=params)
    chat = _chat(client, services, max_tokens=12, **GREEDY)
    assert chat.choices[0].message.content == grpc_chat and chat.choices[0].finish_reason == "length"
    assert chat.usage.completion_tokens == 12 and chat.usage.prompt_tokens == last.usage.prompt_tokens
    _, grpc_text, _, _ = generate(services.stub, prompt=TINY_PROMPTS[1], params=params)
    text = client.completions.create(model=services.model_name, prompt=TINY_PROMPTS[1], max_tokens=12, **GREEDY)
    assert text.choices[0].text == grpc_text and text.object == "text_completion"


def test_streamed_chat_equals_whole_and_ends_with_usage(client, services):
    whole = _chat(client, services, max_tokens=10, **GREEDY)
    chunks = list(_chat(client, services, max_tokens=10, stream=True, stream_options={"include_usage": True},
                        **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == 10
    assert all(c.usage is None for c in chunks[:-1])
    assert last.usage.prompt_tokens_details.cached_tokens > 0  # the same prompt as `whole`, cached
    assert last.usage.model_extra["speculation"]["draft_tokens"] == 0  # no draft service here
    assert len({c.id for c in chunks}) == 1


def test_streamed_completion_equals_whole(client, services):
    kw = dict(model=services.model_name, prompt=TINY_PROMPTS[2], max_tokens=8, **GREEDY)
    whole = client.completions.create(**kw).choices[0].text
    assert "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw)) == whole


def test_n_2_gives_two_choices_whole_and_streamed(client, services):
    reply = _chat(client, services, n=2, max_tokens=6, temperature=1.0, seed=5)
    assert sorted(c.index for c in reply.choices) == [0, 1] and reply.usage.completion_tokens <= 12
    streamed: dict[int, str] = {}
    for chunk in _chat(client, services, n=2, max_tokens=6, temperature=1.0, seed=5, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + (choice.delta.content or "")
    assert streamed == {c.index: c.message.content for c in reply.choices}  # seeded: the same draws


def test_seeded_sampling_is_reproducible(client, services):
    def sample(seed):
        return _chat(client, services, max_tokens=12, temperature=1.0, seed=seed, extra_body={"ignore_eos": True})

    first, again = sample(1234), sample(1234)
    assert first.choices[0].message.content == again.choices[0].message.content
    others = {sample(seed).choices[0].message.content for seed in (1, 2, 3)}
    assert len(others | {first.choices[0].message.content}) > 1


def test_chat_logprobs(client, services):
    reply = _chat(client, services, max_tokens=5, logprobs=True, top_logprobs=3, **GREEDY)
    content = reply.choices[0].logprobs.content
    assert len(content) == 5
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.bytes == list(entry.token.encode())
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)  # greedy: the most likely
        assert entry.token == entry.top_logprobs[0].token
    streamed = [e for c in _chat(client, services, max_tokens=5, logprobs=True, stream=True, **GREEDY)
                if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]


def test_completion_logprobs(client, services):
    reply = client.completions.create(model=services.model_name, prompt=TINY_PROMPTS[0], max_tokens=6, logprobs=2,
                                      **GREEDY)
    lp = reply.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert all(1 <= len(top) <= 2 for top in lp.top_logprobs)
    assert lp.token_logprobs[0] == pytest.approx(max(lp.top_logprobs[0].values()))


def test_stop_strings_and_stop_token_ids(client, services):
    params = pb.SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    ids, text, _, _ = generate(services.stub, prompt=TINY_PROMPTS[3], params=params)
    stop = next(text[i:i + 2] for i in range(3, len(text) - 2) if text[i:i + 2].strip())
    kw = dict(model=services.model_name, prompt=TINY_PROMPTS[3], max_tokens=16, **GREEDY)
    stopped = client.completions.create(stop=[stop, "never-seen-stop"], **kw).choices[0]
    assert stopped.text == text[:text.index(stop)] and stopped.finish_reason == "stop"
    by_id = client.completions.create(**{**kw, "extra_body": {"ignore_eos": True, "stop_token_ids": [ids[4]]}})
    assert by_id.choices[0].finish_reason == "stop" and by_id.usage.completion_tokens == ids.index(ids[4]) + 1


def test_vllm_sampling_extras_are_accepted(client, services):
    reply = _chat(client, services, max_tokens=4, temperature=0.8, top_p=0.9, presence_penalty=0.5,
                  frequency_penalty=0.2, logit_bias={"5": 1.5}, user="someone",
                  extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "ignore_eos": True})
    assert reply.usage.completion_tokens == 4


def test_structured_output_by_response_format_and_vllms_names(client, services):
    """OpenAI's response_format and vLLM's guided_* carry tandem's structured output: even the
    tiny random model's text keeps to the grammar (docs/structured-output.md)."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    reply = _chat(client, services, max_tokens=16, temperature=0,
                  response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}})
    assert reply.choices[0].finish_reason == "stop" and json.loads(reply.choices[0].message.content) in (
        {"ok": True}, {"ok": False})
    choice = client.completions.create(model=services.model_name, prompt=TINY_PROMPTS[0], max_tokens=8,
                                       temperature=1.0, extra_body={"guided_choice": ["yes", "no"]})
    assert choice.choices[0].text in ("yes", "no")
    whole = _chat(client, services, max_tokens=32, temperature=0, response_format={"type": "json_object"})
    if whole.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(whole.choices[0].message.content), dict)


def test_raw_server_sent_events(services):
    """The wire format itself: `data: <json>` events, a blank line after each, `data: [DONE]`."""
    body = {"model": services.model_name, "messages": CHAT, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    with httpx2.stream("POST", f"{services.base_url}/chat/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        assert response.headers["x-request-id"]
        raw = response.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    payloads = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert all(e.startswith("data: ") for e in events[:-1])
    assert {p["object"] for p in payloads} == {"chat.completion.chunk"}
    assert payloads[-1]["usage"]["completion_tokens"] == 4 and payloads[-1]["choices"] == []
    assert payloads[-1]["usage"]["total_tokens"] == payloads[-1]["usage"]["prompt_tokens"] + 4


def test_a_client_that_disconnects_cancels_its_request(client, services):
    """Its handler is cancelled, and with it the request: the target's pages come back (the
    suite's no_leaks check) and nothing keeps running."""
    stream = _chat(client, services, max_tokens=400, stream=True, **GREEDY)
    for i, _ in enumerate(stream):
        if i == 2:
            break
    assert snapshot(services.router_engine).requests_running == 1
    stream.close()
    deadline = time.monotonic() + 30
    while snapshot(services.router_engine).requests_running and time.monotonic() < deadline:
        time.sleep(0.02)
    assert snapshot(services.router_engine).requests_running == 0
    cancelled = services.stub.Stats(pb.StatsRequest(), timeout=10).finished_by_reason["cancelled"]
    assert cancelled >= 1
