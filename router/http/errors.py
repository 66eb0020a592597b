"""Errors of the OpenAI-compatible API in OpenAI's JSON shape, {"error": {"message", "type",
"param", "code"}}, with the HTTP status each of tandem's typed errors (tandem.errors) maps to.

Words: `param` names the OpenAI request field at fault (`temperature`, `messages`), never the
protobuf one the shared validation names (`params.temperature`); a request's own names (which of
max_tokens and max_completion_tokens it sent, completions' `logprobs` for top_logprobs) come
with the request (openai_request.OpenAIRequest.names)."""

import json
import math
import re

from aiohttp import web

from router.overload import DO_NOT_RETRY_MS
from tandem.errors import TandemError

# RequestLimits caps on how much a request carries (its bytes, its messages): past them the
# payload is too large (413); every other limit is a bad value (400).
SIZE_CAPS = ("max_prompt_bytes", "max_messages", "max_request_id_bytes")
# The field a shared validation message begins with: `params.top_p = 2: ...`, `messages[2].role`.
_FIELD = re.compile(r"^(?:params\.)?([a-z_]+)")


class HttpError(Exception):
    """A refusal with its HTTP status, sent as OpenAI's error object."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> web.Response:
        return web.Response(status=self.status, text=json.dumps(self.body()), content_type="application/json",
                            headers=self.headers)


def bad_request(param: str | None, message: str) -> HttpError:
    return HttpError(400, message, param=param)


def unauthenticated(message: str) -> HttpError:
    return HttpError(401, message, code="invalid_api_key")


def model_not_found(model: str) -> HttpError:
    return HttpError(404, f"The model `{model}` does not exist (GET /v1/models lists this server's)",
                     param="model", code="model_not_found")


def too_large(message: str, param: str | None = None) -> HttpError:
    return HttpError(413, message, param=param, code="request_too_large")


def unavailable(message: str) -> HttpError:
    return HttpError(503, message, type="server_error", code="service_unavailable")


def from_tandem(error: TandemError, names: dict[str, str], submitted: bool) -> HttpError:
    """The HTTP error of a TandemError. `names`: the shared validation's field names (without
    `params.`) -> the request's own; `submitted`: the request reached the engine (a
    FAILED_PRECONDITION then is the target's state, 503; before it, the request's, 400)."""
    message = _own_names(str(error), names)
    match error.code:
        case "INVALID_ARGUMENT":
            param = _param(str(error), names)
            if any(f"({cap})" in message for cap in SIZE_CAPS):
                return too_large(message, param)
            code = "context_length_exceeded" if "the context" in message else None
            return HttpError(400, message, param=param, code=code)
        case "RESOURCE_EXHAUSTED":
            return _exhausted(message, getattr(error, "retry_after_ms", None))
        case "NOT_FOUND":
            return HttpError(404, message, code="not_found")
        case "UNAVAILABLE":
            return unavailable(message)
        case "FAILED_PRECONDITION":
            return unavailable(message) if submitted else HttpError(400, message, param=_param(str(error), names))
        case _:
            return HttpError(500, message, type="server_error", code="internal_error")


def _exhausted(message: str, retry_after_ms: int | None) -> HttpError:
    """A full queue: 429 with when to come back (Retry-After in whole seconds, and OpenAI's
    retry-after-ms, which its SDKs read first). A request that can never fit: 413, no retry."""
    if retry_after_ms is not None and retry_after_ms <= DO_NOT_RETRY_MS:
        return too_large(message)
    headers = {}
    if retry_after_ms is not None:
        headers = {"Retry-After": str(max(1, math.ceil(retry_after_ms / 1000))), "retry-after-ms": str(retry_after_ms)}
    return HttpError(429, message, type="rate_limit_error", code="rate_limit_exceeded", headers=headers)


def _param(message: str, names: dict[str, str]) -> str | None:
    match = _FIELD.match(message)
    return names.get(match.group(1)) if match else None


def _own_names(message: str, names: dict[str, str]) -> str:
    """`params.top_logprobs = 30: ...` as `logprobs = 30: ...` for a completions request."""
    for pb_name, own in names.items():
        message = re.sub(rf"\bparams\.{pb_name}\b", own, message)
    return message.replace("params.", "")
