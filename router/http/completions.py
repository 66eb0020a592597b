"""POST /v1/chat/completions and /v1/completions: the OpenAI body translated to tandem's
GenerateRequest (openai_request), validated and tokenized as the gRPC port does
(router.stream.spec_of), submitted to the same engine, its deltas shaped (responses) into one
JSON response or server-sent events.

A refusal is an HTTP status, never a stream that breaks: the engine's synchronous refusals (a
full queue: 429 with Retry-After; draining: 503) and anything that ends the request before its
first token come before the response's headers, which go out with the first chunk. A client
that disconnects cancels its handler (HttpApi.start), which cancels the request and frees its
sequences (stream.deltas)."""

import asyncio
import contextlib
import json
import time

from aiohttp import web

from router import convert, stream
from router.http.errors import bad_request, from_tandem, too_large, unavailable
from router.http.openai_request import CHAT, OpenAIRequest, chat_request, completion_request
from router.http.responses import Shaper
from tandem.errors import TandemError
from tandem.telemetry.tracing import ending

PARSE_ON_LOOP_BYTES = 256 * 1024  # larger bodies are parsed in a thread: the loop streams meanwhile
_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def generate(api, request: web.Request, kind: str) -> web.StreamResponse:
    """`api`: the router.http.app.HttpApi serving it."""
    arrived = time.monotonic()  # TTFT and duration count parsing and tokenizing, as on gRPC
    body = await _read_json(request)
    translate = chat_request if kind == CHAT else completion_request
    req = translate(body, request.headers.get("X-Request-Id", ""))
    api.check_model(req.model)
    engine = api.engine
    if not engine.serving:
        raise unavailable("the target service is down or serves another model; retry shortly")
    metadata = [(name.lower(), value) for name, value in request.headers.items()]  # trace context, key id
    span = engine.tracing.start_request(metadata, "chat" if kind == CHAT else "text_completion")
    with ending(span):
        try:
            span.add_event("start tokenize")
            spec = await stream.spec_of(engine, req.message)
            span.add_event("finish tokenize")
            submitted = engine.submit(spec, span, arrived)
        except TandemError as e:
            raise from_tandem(e, req.names, submitted=False) from e
        shaper = Shaper(req, spec.request_id, api.model_name, engine.tokenizer)
        async with contextlib.aclosing(stream.deltas(engine, submitted)) as deltas:
            if req.stream:
                return await _stream(request, req, deltas, shaper, submitted)
            return await _whole(req, deltas, shaper, submitted)


async def _whole(req: OpenAIRequest, deltas, shaper: Shaper, submitted) -> web.Response:
    try:
        async for delta, _ in deltas:
            shaper.add(delta)
    except TandemError as e:
        raise from_tandem(e, req.names, submitted=True) from e
    body = shaper.whole(convert.usage_to_pb(submitted))
    return web.json_response(body, headers={"X-Request-Id": submitted.spec.request_id})


async def _stream(request: web.Request, req: OpenAIRequest, deltas, shaper: Shaper, submitted) -> web.StreamResponse:
    """Server-sent events: `data: <chunk>` each, `data: [DONE]` last. An error after the first
    chunk is an event of OpenAI's error object (its SDKs raise it), then [DONE]."""
    response = None
    try:
        async for delta, last in deltas:
            if response is None:  # the first chunk commits the stream: a refusal before it is a status
                response = web.StreamResponse(headers={**_SSE_HEADERS, "X-Request-Id": submitted.spec.request_id})
                await response.prepare(request)
            await _event(response, shaper.chunk(delta))
            if last and req.include_usage:
                await _event(response, shaper.usage_chunk(convert.usage_to_pb(submitted)))
    except TandemError as e:
        error = from_tandem(e, req.names, submitted=True)
        if response is None:
            raise error from e
        await _event(response, error.body())
    except ConnectionResetError:  # the client went away mid-write: aclosing cancels the request
        return response
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


async def _event(response: web.StreamResponse, payload: dict) -> None:
    await response.write(b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n")


async def _read_json(request: web.Request):
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise too_large(f"the request body is larger than {request.client_max_size} bytes") from None
    try:
        if len(raw) > PARSE_ON_LOOP_BYTES:
            return await asyncio.to_thread(json.loads, raw)
        return json.loads(raw)
    except ValueError:  # UnicodeDecodeError included
        raise bad_request(None, "the request body is not valid JSON") from None

