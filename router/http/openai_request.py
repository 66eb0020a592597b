"""OpenAI request bodies (chat completions, completions) as tandem's own GenerateRequest, so that
the HTTP API shares the gRPC API's validation, limits and error messages (router.stream.spec_of).

This module checks only what the protobuf message cannot hold: JSON types, integer ranges of its
fields, and OpenAI fields that tandem has no equivalent for, each refused with a 400 naming the
parameter. Ranges and limits (temperature >= 0, n <= --max-n, ...) are the shared validation's.
vLLM's extra names (top_k, min_p, repetition_penalty, ignore_eos, stop_token_ids; guided_json,
guided_regex, guided_grammar, guided_choice) carry the parameters OpenAI has no field for;
`speculate` is tandem's own."""

import json
from dataclasses import dataclass, field

from router.http.errors import bad_request
from tandem.v1 import generate_pb2 as pb

CHAT, COMPLETION = "chat", "completion"
_UINT32, _INT32, _UINT64 = (0, 2**32 - 1), (-(2**31), 2**31 - 1), (0, 2**64 - 1)
# Accepted and without effect here: who asked (`user`), tags for OpenAI's dashboard.
_IGNORED = ("user", "metadata", "service_tier", "parallel_tool_calls")
# OpenAI fields of behaviour tandem does not have: refused by name rather than ignored.
_UNSUPPORTED = {
    "tools": "tool calls", "functions": "function calls", "function_call": "function calls",
    "audio": "audio output", "prediction": "predicted outputs", "web_search_options": "web search",
    "reasoning_effort": "reasoning models", "suffix": "suffixes (insertion)",
}
# The shared validation's parameter names (its messages say `params.<name>`) that a request
# sends under the same name.
_SAME_NAMES = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "frequency_penalty",
               "presence_penalty", "logit_bias", "seed", "stop", "stop_token_ids", "n", "logprobs", "top_logprobs")


@dataclass(frozen=True, slots=True)
class OpenAIRequest:
    """What a response needs besides the deltas: its kind, whether it streams, and the names
    the request used (errors.from_tandem names the client's parameter, not the protobuf's)."""

    kind: str  # CHAT | COMPLETION
    message: pb.GenerateRequest
    model: str | None
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage: a last chunk with the usage
    logprobs: bool = False
    names: dict[str, str] = field(default_factory=dict)


class _Body:
    """A JSON object read field by field; what is left at the end was not recognised."""

    def __init__(self, body):
        if not isinstance(body, dict):
            raise bad_request(None, "the request body must be a JSON object")
        self._left = dict(body)

    def take(self, name: str):
        return self._left.pop(name, None)

    def given(self, name: str) -> bool:
        return self._left.get(name) is not None

    def integer(self, name: str, bounds: tuple[int, int] = _UINT32) -> int | None:
        value = self.take(name)
        if value is None:
            return None
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int) or not bounds[0] <= value <= bounds[1]:
            raise bad_request(name, f"{name} = {value!r}: must be an integer in [{bounds[0]}, {bounds[1]}]")
        return value

    def number(self, name: str) -> float | None:
        value = self.take(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
            raise bad_request(name, f"{name} = {value!r}: must be a number")
        return value

    def boolean(self, name: str) -> bool | None:
        value = self.take(name)
        if value is not None and not isinstance(value, bool):
            raise bad_request(name, f"{name} = {value!r}: must be true or false")
        return value

    def string(self, name: str) -> str | None:
        value = self.take(name)
        if value is not None and not isinstance(value, str):
            raise bad_request(name, f"{name} must be a string")
        return value

    def finish(self) -> None:
        for name, value in self._left.items():
            if value is None:
                continue
            if name in _UNSUPPORTED:
                raise bad_request(name, f"{name}: tandem does not support {_UNSUPPORTED[name]}")
            raise bad_request(name, f"Unrecognized request argument supplied: {name}")


def chat_request(body, request_id: str = "") -> OpenAIRequest:
    """POST /v1/chat/completions."""
    b = _Body(body)
    message = pb.GenerateRequest(request_id=request_id, messages=_messages(b.take("messages")))
    names = _names(prompt="messages")
    max_tokens, max_completion = b.integer("max_tokens"), b.integer("max_completion_tokens")
    if max_tokens is not None and max_completion is not None and max_tokens != max_completion:
        raise bad_request("max_completion_tokens", "max_tokens and max_completion_tokens differ: send one")
    if max_completion is not None:
        max_tokens, names["max_tokens"] = max_completion, "max_completion_tokens"
    logprobs, top = b.boolean("logprobs"), b.integer("top_logprobs")
    if top and not logprobs:
        raise bad_request("top_logprobs", "top_logprobs requires logprobs: true")
    _params(b, message.params, max_tokens, names)
    message.params.logprobs = bool(logprobs)
    message.params.top_logprobs = top or 0
    _no_tools(b)
    return _finish(b, CHAT, message, names, bool(logprobs))


def completion_request(body, request_id: str = "") -> OpenAIRequest:
    """POST /v1/completions: one prompt (a string or token ids) a request."""
    b = _Body(body)
    message = pb.GenerateRequest(request_id=request_id)
    _prompt(b.take("prompt"), message)
    names = _names(prompt="prompt", top_logprobs="logprobs")
    _params(b, message.params, b.integer("max_tokens"), names)
    logprobs = b.integer("logprobs")
    if logprobs is not None:  # the chosen token's logprob and `logprobs` alternatives
        message.params.logprobs, message.params.top_logprobs = True, logprobs
    if b.boolean("echo"):
        raise bad_request("echo", "echo: tandem does not return the prompt with the completion")
    best_of = b.integer("best_of")
    if best_of is not None and best_of != (message.params.n if message.params.HasField("n") else 1):
        raise bad_request("best_of", "best_of: tandem returns every completion it makes (use n)")
    return _finish(b, COMPLETION, message, names, logprobs is not None)


def _names(**renamed: str) -> dict[str, str]:
    names = {name: name for name in _SAME_NAMES}
    names.update(max_tokens="max_tokens", messages="messages", token_ids="prompt", **renamed)
    return names


def _params(b: _Body, p: pb.SamplingParams, max_tokens: int | None, names: dict[str, str]) -> None:
    """The sampling parameters both endpoints share (and the name structured output came by)."""
    if max_tokens is not None:
        p.max_tokens = max_tokens
    for name in ("temperature", "top_p", "repetition_penalty"):  # optional in the message: set if sent
        if (value := b.number(name)) is not None:
            setattr(p, name, value)
    for name in ("min_p", "frequency_penalty", "presence_penalty"):
        setattr(p, name, b.number(name) or 0.0)
    top_k = b.integer("top_k", _INT32)
    p.top_k = 0 if top_k in (None, -1) else top_k  # vLLM's -1: off
    if (n := b.integer("n")) is not None:
        p.n = n
    if (seed := b.integer("seed", _UINT64)) is not None:
        p.seed = seed
    p.stop.extend(_stops(b.take("stop")))
    p.stop_token_ids.extend(_token_ids(b.take("stop_token_ids"), "stop_token_ids"))
    p.ignore_eos = bool(b.boolean("ignore_eos"))
    if (speculate := b.boolean("speculate")) is not None:
        p.speculate = speculate
    for key, bias in _logit_bias(b.take("logit_bias")):
        p.logit_bias[key] = bias
    names["structured_output"] = _structured(b, p.structured_output) or "response_format"


def _finish(b: _Body, kind: str, message: pb.GenerateRequest, names: dict, logprobs: bool) -> OpenAIRequest:
    model = b.string("model")
    stream = bool(b.boolean("stream"))
    options = b.take("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise bad_request("stream_options", "stream_options is only allowed with stream: true")
        if not isinstance(options, dict) or set(options) - {"include_usage"}:
            raise bad_request("stream_options", "stream_options: only include_usage is supported")
        include_usage = options.get("include_usage") is True
    for name in _IGNORED:
        b.take(name)
    b.finish()
    return OpenAIRequest(kind, message, model, stream, include_usage, logprobs, names)


# vLLM's names for structured output: field -> StructuredOutput kind.
_GUIDED = {"guided_json": "json_schema", "guided_regex": "regex", "guided_grammar": "grammar",
           "guided_choice": "choice"}


def _structured(b: _Body, out: pb.StructuredOutput) -> str | None:
    """OpenAI's response_format (json_object, json_schema) or one of vLLM's guided_* fields as
    StructuredOutput (docs/structured-output.md); returns the field that set it."""
    given = [name for name in ("response_format", *_GUIDED) if b.given(name)]
    if len(given) > 1:
        raise bad_request(given[1], f"{' and '.join(given)}: send one")
    fmt = b.take("response_format")
    if fmt is not None:
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        schema = (fmt.get("json_schema") or {}).get("schema") if kind == "json_schema" else None
        if kind == "json_object":
            out.json_object = True
        elif kind == "json_schema" and isinstance(schema, dict):
            out.json_schema = json.dumps(schema)
        elif kind != "text":
            raise bad_request("response_format", "response_format: type text, json_object, or json_schema with"
                                                 " json_schema.schema an object")
    for name, kind in _GUIDED.items():
        value = b.take(name)
        if value is None:
            continue
        if kind == "choice":
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise bad_request(name, f"{name} must be an array of strings")
            out.choice.values.extend(value)
        elif kind == "json_schema" and isinstance(value, dict):
            out.json_schema = json.dumps(value)
        elif isinstance(value, str):
            setattr(out, kind, value)
        else:
            raise bad_request(name, f"{name} must be a string" + (" or an object" if kind == "json_schema" else ""))
    return given[0] if given else None


def _no_tools(b: _Body) -> None:
    """Chat fields that are fine while they ask for nothing tandem lacks."""
    if b.take("tools") not in (None, []):
        raise bad_request("tools", "tools: tandem does not support tool calls")
    if b.take("tool_choice") not in (None, "none", "auto"):
        raise bad_request("tool_choice", "tool_choice: tandem does not support tool calls")
    if b.take("modalities") not in (None, ["text"]):
        raise bad_request("modalities", "modalities: tandem answers in text only")
    if b.take("store"):
        raise bad_request("store", "store: tandem keeps no completions")


def _messages(value) -> list[pb.ChatMessage]:
    if not isinstance(value, list) or not value:
        raise bad_request("messages", "messages must be a non-empty array")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad_request("messages", f"messages[{i}] must be an object with a role")
        if m["role"] in ("tool", "function") or m.get("tool_calls") or m.get("function_call"):
            raise bad_request("messages", f"messages[{i}]: tandem does not support tool calls")
        role = "system" if m["role"] == "developer" else m["role"]  # OpenAI's newer name for it
        out.append(pb.ChatMessage(role=role, content=_content(m.get("content"), i)))
    return out


def _content(content, i: int) -> str:
    """A message's text: a string, or its text parts joined with newlines (as vLLM does)."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise bad_request("messages", f"messages[{i}].content must be a string or an array of text parts")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise bad_request("messages", f"messages[{i}].content[{j}]: tandem reads text parts only")
        texts.append(part["text"])
    return "\n".join(texts)


def _prompt(value, message: pb.GenerateRequest) -> None:
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str | list):
        value = value[0]  # a batch of one
    if isinstance(value, str):
        message.prompt = value
    elif isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        message.token_ids.extend(_token_ids(value, "prompt"))
    elif isinstance(value, list) and len(value) > 1:
        raise bad_request("prompt", "prompt: one prompt a request (send the others as requests of their own)")
    else:
        raise bad_request("prompt", "prompt must be a string or an array of token ids")


def _stops(value) -> list[str]:
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad_request("stop", "stop must be a string or an array of strings")
    return stops


def _token_ids(value, name: str) -> list[int]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise bad_request(name, f"{name} must be an array of token ids")
    for i, t in enumerate(value):
        if isinstance(t, bool) or not isinstance(t, int) or not _INT32[0] <= t <= _INT32[1]:
            raise bad_request(name, f"{name}[{i}] = {t!r}: not a token id")
    return value


def _logit_bias(value) -> list[tuple[int, float]]:
    if value is None:
        return []
    if not isinstance(value, dict):
        raise bad_request("logit_bias", "logit_bias must be an object of token id -> bias")
    out = []
    for key, bias in value.items():
        try:
            token = int(key)
        except ValueError:
            raise bad_request("logit_bias", f"logit_bias key {key!r}: not a token id") from None
        if not _INT32[0] <= token <= _INT32[1] or isinstance(bias, bool) or not isinstance(bias, int | float):
            raise bad_request("logit_bias", f"logit_bias[{key!r}] = {bias!r}: must map a token id to a number")
        out.append((token, float(bias)))
    return out
