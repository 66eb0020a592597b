"""OpenAI bodies as tandem's GenerateRequest, and tandem's errors as OpenAI's: literal cases,
no servers."""

import pytest

from router.http.errors import HttpError, from_tandem
from router.http.openai_request import CHAT, COMPLETION, chat_request, completion_request
from router.http.responses import Shaper, usage_dict
from router.overload import NeverFits, QueueFull
from router.request import Delta, FinishReason, TokenOut
from tandem.errors import FailedPrecondition, InvalidArgument, TandemError, Unavailable
from tandem.v1 import generate_pb2 as pb

MESSAGES = [{"role": "developer", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "a"},
                                                                                         {"type": "text", "text": "b"}]}]


def test_a_chat_body_maps_field_by_field():
    req = chat_request({
        "model": "m", "messages": MESSAGES, "max_completion_tokens": 7, "temperature": 0.5, "top_p": 0.9, "n": 2,
        "seed": 2**64 - 1, "stop": "END", "logit_bias": {"12": -100}, "presence_penalty": 1, "frequency_penalty": 0.5,
        "logprobs": True, "top_logprobs": 3, "user": "u", "stream": True, "stream_options": {"include_usage": True},
        "top_k": -1, "min_p": 0.1, "repetition_penalty": 1.2, "ignore_eos": True, "stop_token_ids": [4],
        "tools": [], "tool_choice": "none", "response_format": {"type": "text"},
    }, request_id="r1")
    m, p = req.message, req.message.params
    assert req.kind == CHAT and req.model == "m" and req.stream and req.include_usage and req.logprobs
    assert m.request_id == "r1" and [(x.role, x.content) for x in m.messages] == [("system", "be brief"), ("user", "a\nb")]
    assert p.max_tokens == 7 and p.n == 2 and p.seed == 2**64 - 1 and list(p.stop) == ["END"]
    assert p.temperature == 0.5 and p.top_p == pytest.approx(0.9) and p.top_k == 0 and p.min_p == pytest.approx(0.1)
    assert dict(p.logit_bias) == {12: -100.0} and p.presence_penalty == 1 and p.frequency_penalty == 0.5
    assert p.logprobs and p.top_logprobs == 3 and p.ignore_eos and list(p.stop_token_ids) == [4]
    assert p.repetition_penalty == pytest.approx(1.2)
    assert req.names["max_tokens"] == "max_completion_tokens" and req.names["prompt"] == "messages"


def test_unset_fields_stay_unset_for_the_shared_defaults():
    p = chat_request({"messages": MESSAGES}).message.params
    for name in ("max_tokens", "temperature", "top_p", "repetition_penalty", "seed", "n", "speculate"):
        assert not p.HasField(name), name


def test_a_completion_body_maps_prompts_and_logprobs():
    req = completion_request({"prompt": [[5, 6, 7]], "logprobs": 2, "max_tokens": 3, "best_of": 1})
    assert req.kind == COMPLETION and list(req.message.token_ids) == [5, 6, 7]
    assert req.message.params.logprobs and req.message.params.top_logprobs == 2 and req.logprobs
    assert req.names["top_logprobs"] == "logprobs" and req.names["token_ids"] == "prompt"
    assert completion_request({"prompt": ["text"]}).message.prompt == "text"
    assert completion_request({"prompt": "text", "logprobs": 0}).message.params.logprobs


@pytest.mark.parametrize("body, param", [
    ({"messages": []}, "messages"),
    ({"messages": MESSAGES, "temperature": "hot"}, "temperature"),
    ({"messages": MESSAGES, "n": True}, "n"),
    ({"messages": MESSAGES, "max_tokens": 2**32}, "max_tokens"),
    ({"messages": MESSAGES, "max_tokens": 3, "max_completion_tokens": 4}, "max_completion_tokens"),
    ({"messages": MESSAGES, "stop": [1]}, "stop"),
    ({"messages": MESSAGES, "logit_bias": {"x": 1}}, "logit_bias"),
    ({"messages": MESSAGES, "stop_token_ids": [2**40]}, "stop_token_ids"),
    ({"messages": MESSAGES, "functions": [{"name": "f"}]}, "functions"),
    ({"messages": MESSAGES, "store": True}, "store"),
    ({"messages": MESSAGES, "stream": True, "stream_options": {"continuous": 1}}, "stream_options"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages"),
    ({"messages": MESSAGES, "model": 5}, "model"),
    ({"messages": MESSAGES, "whatever": 0}, "whatever"),
])
def test_a_bad_chat_body_names_its_parameter(body, param):
    with pytest.raises(HttpError) as info:
        chat_request(body)
    assert info.value.status == 400 and info.value.param == param


@pytest.mark.parametrize("body, param", [
    ({"prompt": 5}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": "a", "suffix": "b"}, "suffix"),
    ({"prompt": "a", "best_of": 3}, "best_of"),
    ({"prompt": "a", "max_completion_tokens": 3}, "max_completion_tokens"),  # chat's name only
])
def test_a_bad_completion_body_names_its_parameter(body, param):
    with pytest.raises(HttpError) as info:
        completion_request(body)
    assert info.value.param == param


def test_structured_output_from_response_format_or_vllms_names():
    schema = {"type": "object"}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    req = chat_request({"messages": MESSAGES, "response_format": fmt})
    assert req.message.params.structured_output.json_schema == '{"type": "object"}'
    assert req.names["structured_output"] == "response_format"
    assert chat_request({"messages": MESSAGES, "response_format": {"type": "json_object"}}
                        ).message.params.structured_output.json_object
    assert not chat_request({"messages": MESSAGES, "response_format": {"type": "text"}}
                            ).message.params.HasField("structured_output")
    req = completion_request({"prompt": "x", "guided_choice": ["a", "b"]})
    assert list(req.message.params.structured_output.choice.values) == ["a", "b"]
    assert req.names["structured_output"] == "guided_choice"
    assert completion_request({"prompt": "x", "guided_json": schema}).message.params.structured_output.json_schema
    assert completion_request({"prompt": "x", "guided_regex": "a+"}).message.params.structured_output.regex == "a+"
    for body, param in (({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
                        ({"guided_choice": "b"}, "guided_choice"), ({"response_format": {"type": "xml"}}, "response_format")):
        with pytest.raises(HttpError) as info:
            completion_request({"prompt": "x", **body})
        assert info.value.param == param


def test_null_fields_are_absent():
    assert chat_request({"messages": MESSAGES, "tools": None, "frobnicate": None, "stop": None}).message.params.stop == []


NAMES = completion_request({"prompt": "x"}).names


@pytest.mark.parametrize("error, status, param, code", [
    (InvalidArgument("params.temperature = -1.0: must be finite and >= 0"), 400, "temperature", None),
    (InvalidArgument("params.top_logprobs = 30: at most 20 (max_top_logprobs)"), 400, "logprobs", None),
    (InvalidArgument("params.structured_output.regex: unclosed group"), 400, "response_format", None),
    (InvalidArgument("prompt has 600 tokens; the context holds 512 (prompt + at least 1)"), 400, "prompt",
     "context_length_exceeded"),
    (InvalidArgument("token_ids[3] = -1: outside the vocabulary [0, 256)"), 400, "prompt", None),
    (InvalidArgument("prompt has 5000 bytes: at most 4096 (max_prompt_bytes)"), 413, "prompt", "request_too_large"),
    (NeverFits("prompt + max_tokens needs 900 tokens; the KV cache holds 256"), 413, None, "request_too_large"),
    (Unavailable("the router is shutting down"), 503, None, "service_unavailable"),
    (TandemError("boom"), 500, None, "internal_error"),
])
def test_tandem_errors_map_to_http(error, status, param, code):
    http = from_tandem(error, NAMES, submitted=False)
    assert (http.status, http.param, http.code) == (status, param, code)
    assert "params." not in http.message


def test_a_full_queue_is_429_with_retry_after_in_seconds_and_ms():
    error = QueueFull(3)
    error.retry_after_ms = 1500
    http = from_tandem(error, NAMES, submitted=False)
    assert http.status == 429 and http.headers == {"Retry-After": "2", "retry-after-ms": "1500"}


def test_a_failed_precondition_is_the_request_before_submit_and_the_target_after():
    error = FailedPrecondition("the target service restarted with another model")
    assert from_tandem(error, NAMES, submitted=False).status == 400
    assert from_tandem(error, NAMES, submitted=True).status == 503


class _Tokenizer:
    def token_text(self, token_id: int) -> str:
        return {1: "ab", 2: "c", 3: "\ufffd"}[token_id]


def test_completion_logprobs_and_offsets_across_chunks():
    req = completion_request({"prompt": "x", "logprobs": 1})
    shaper = Shaper(req, "id", "m", _Tokenizer())
    first = shaper.chunk(Delta("ab", (TokenOut(1, -0.5, ((1, -0.5),)),), None, 0))
    last = shaper.chunk(Delta("c", (TokenOut(2, float("-inf"), ((2, -1.0),)),), FinishReason.LENGTH, 0))
    assert first["choices"][0]["logprobs"]["text_offset"] == [0]
    assert last["choices"][0]["logprobs"] == {"tokens": ["c"], "token_logprobs": [-9999.0],
                                              "top_logprobs": [{"c": -1.0}], "text_offset": [2]}
    assert last["choices"][0]["finish_reason"] == "length" and last["object"] == "text_completion"


def test_a_whole_chat_response_gathers_each_choice():
    req = chat_request({"messages": MESSAGES, "n": 2, "logprobs": True})
    shaper = Shaper(req, "id", "m", _Tokenizer())
    for index in (0, 1):
        shaper.add(Delta("ab", (TokenOut(1, -0.1),), None, index))
        shaper.add(Delta("c", (TokenOut(3, -0.2),), FinishReason.STOP, index))
    usage = pb.Usage(prompt_tokens=4, completion_tokens=4, cached_prompt_tokens=2, draft_tokens=3,
                     accepted_draft_tokens=2, verify_steps=1, accepted_by_depth=[1, 1])
    whole = shaper.whole(usage)
    assert [c["message"]["content"] for c in whole["choices"]] == ["abc", "abc"]
    assert whole["choices"][0]["logprobs"]["content"][1] == {"token": "\ufffd", "logprob": -0.2,
                                                             "bytes": [239, 191, 189], "top_logprobs": []}
    assert whole["usage"] == usage_dict(usage) and whole["usage"]["total_tokens"] == 8
    assert whole["usage"]["prompt_tokens_details"] == {"cached_tokens": 2}
    assert whole["usage"]["speculation"]["accepted_by_depth"] == [1, 1]
