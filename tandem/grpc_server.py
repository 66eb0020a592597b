"""gRPC plumbing shared by the three services: message limits, the one interceptor that maps
typed errors to status codes, health, reflection and graceful shutdown."""

import inspect
import logging
import signal
import threading
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from dataclasses import dataclass

import grpc
from grpc_health.v1 import _async as health_aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from tandem.errors import InvalidArgument, TandemError
from tandem.v1 import engine_pb2

log = logging.getLogger(__name__)

# Tensors travel between the model services; the 4 MiB default is far too small.
MAX_MESSAGE_BYTES = 256 * 1024 * 1024
KEEPALIVE_MS = 30_000
# A channel whose server went away retries with exponential backoff up to 120 s by default: a
# draft or target restarted by compose would wait up to two minutes to be seen again.
MAX_RECONNECT_BACKOFF_MS = 2_000
CHANNEL_OPTIONS = [
    ("grpc.max_reconnect_backoff_ms", MAX_RECONNECT_BACKOFF_MS),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", KEEPALIVE_MS),
]
# A server counts pings closer than this (5 minutes by default) on a connection without data as
# strikes and drops it with "Too many pings" after two: our long-lived Steps, Drafts and Peer
# streams idle between requests while the other side pings every KEEPALIVE_MS. CI saw the
# draft's peer stream dropped that way; so the servers accept the pings they are sent.
SERVER_OPTIONS = [
    *CHANNEL_OPTIONS,
    ("grpc.so_reuseport", 0),
    ("grpc.http2.min_ping_interval_without_data_ms", KEEPALIVE_MS // 2),
]
# The router's public port carries prompts, not tensors: a message past this gets
# RESOURCE_EXHAUSTED from gRPC before it is read whole. Room for the largest prompt the
# router's request limits admit (router.limits.RequestLimits.max_prompt_bytes) and more.
PUBLIC_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
PUBLIC_SERVER_OPTIONS = [
    *(o for o in SERVER_OPTIONS if o[0] != "grpc.max_receive_message_length"),
    ("grpc.max_receive_message_length", PUBLIC_MAX_MESSAGE_BYTES),
]
GRACE_SECONDS = 5.0


def status_of(error: TandemError) -> grpc.StatusCode:
    return getattr(grpc.StatusCode, error.code, grpc.StatusCode.INTERNAL)


RETRY_PUSHBACK = "grpc-retry-pushback-ms"  # gRPC's retry pushback (proposal A6): clients with a retry policy wait this long


def pushback(error: TandemError) -> tuple[tuple[str, str], ...]:
    """Trailing metadata telling a client when to come back, for errors that know."""
    after = getattr(error, "retry_after_ms", None)
    return () if after is None else ((RETRY_PUSHBACK, str(int(after))),)


def answer_each(request_iterator, answer: Callable, failed: Callable) -> Iterator:
    """A stream of calls (TargetEngine.Steps, DraftEngine.Drafts): `answer(message)` for each
    message, in order; one that raises is answered `failed(message, StepError)` and the stream
    goes on. A typed error keeps its status; anything else is a bug, logged with its traceback
    (a unary call would end UNKNOWN with the same text)."""
    for message in request_iterator:
        try:
            yield answer(message)
        except TandemError as e:
            yield failed(message, engine_pb2.StepError(code=status_of(e).value[0], message=str(e)))
        except Exception as e:
            log.error("unexpected error answering a stream's message", exc_info=e)
            text = f"{type(e).__name__}: {e}"
            yield failed(message, engine_pb2.StepError(code=grpc.StatusCode.INTERNAL.value[0], message=text))


@dataclass(frozen=True, slots=True)
class Undecodable:
    """What a request message becomes when its bytes do not parse (truncated, invalid UTF-8 in
    a string field, garbage): gRPC would end the call UNKNOWN (aio) or INTERNAL (sync) if the
    deserializer raised; the wrapped handler answers INVALID_ARGUMENT with `reason` instead."""

    reason: str


def _decoding(deserializer: Callable | None, method: str) -> Callable | None:
    """`deserializer` that returns Undecodable rather than raising."""
    if deserializer is None:
        return None
    message = getattr(getattr(deserializer, "__self__", None), "DESCRIPTOR", None)
    name = message.full_name if message is not None else "the request"

    def deserialize(data: bytes):
        try:
            return deserializer(data)
        except Exception as e:  # DecodeError, or whatever else a parser raises on bad bytes
            return Undecodable(f"cannot parse {name} (a request of {method}): {e}")

    return deserialize


def _sync_requests(requests: Iterator, context) -> Iterator:
    """A request stream that stops at its first undecodable message. The status is set here
    too: a reader thread (the target's Peer) may be the one that meets it."""
    for message in requests:
        if isinstance(message, Undecodable):
            context.set_code(grpc.StatusCode.INVALID_ARGUMENT)
            context.set_details(message.reason)
            raise InvalidArgument(message.reason)
        yield message


async def _aio_requests(requests) -> AsyncIterator:
    async for message in requests:
        if isinstance(message, Undecodable):
            raise InvalidArgument(message.reason)
        yield message


def _argument(request, request_streaming: bool, requests: Callable):
    """The behavior's first argument: the request, or the request stream passed through
    `requests`; InvalidArgument for an undecodable unary request."""
    if request_streaming:
        return requests(request)
    if isinstance(request, Undecodable):
        raise InvalidArgument(request.reason)
    return request


def _wrap_sync(behavior: Callable, request_streaming: bool, response_streaming: bool) -> Callable:
    def unary(request, context):
        try:
            return behavior(_argument(request, request_streaming, lambda it: _sync_requests(it, context)), context)
        except TandemError as e:
            context.set_trailing_metadata(pushback(e))
            context.abort(status_of(e), str(e))

    def stream(request, context):
        try:
            yield from behavior(_argument(request, request_streaming, lambda it: _sync_requests(it, context)), context)
        except TandemError as e:
            context.set_trailing_metadata(pushback(e))
            context.abort(status_of(e), str(e))

    return stream if response_streaming else unary


def _wrap_aio(behavior: Callable, request_streaming: bool, response_streaming: bool) -> Callable:
    async def unary(request, context):
        try:
            return await behavior(_argument(request, request_streaming, _aio_requests), context)
        except TandemError as e:
            context.set_trailing_metadata(pushback(e))
            await context.abort(status_of(e), str(e))

    async def stream(request, context):
        try:
            responses = behavior(_argument(request, request_streaming, _aio_requests), context)
            if inspect.isawaitable(responses):  # a coroutine that streams with context.write (grpc's aio Health.Watch)
                await responses
                return
            async for item in responses:
                yield item
        except TandemError as e:
            context.set_trailing_metadata(pushback(e))
            await context.abort(status_of(e), str(e))

    # Always an async generator for a stream: an interceptor outside this one (tandem.security's
    # guard) iterates what it wraps.
    return stream if response_streaming else unary


_HANDLERS = {  # (request streaming, response streaming): the behavior's attribute, its factory
    (False, False): ("unary_unary", grpc.unary_unary_rpc_method_handler),
    (False, True): ("unary_stream", grpc.unary_stream_rpc_method_handler),
    (True, False): ("stream_unary", grpc.stream_unary_rpc_method_handler),
    (True, True): ("stream_stream", grpc.stream_stream_rpc_method_handler),
}


def rewrap_handler(handler, wrap: Callable, request_deserializer=None):
    """The same method handler with its behavior wrapped: `wrap(behavior, request_streaming,
    response_streaming)` (and another request deserializer if given). Interceptors use it."""
    if handler is None:
        return None
    kind = (handler.request_streaming, handler.response_streaming)
    attribute, factory = _HANDLERS[kind]
    return factory(wrap(getattr(handler, attribute), *kind),
                   request_deserializer=request_deserializer or handler.request_deserializer,
                   response_serializer=handler.response_serializer)


def _wrapped_handler(handler, wrap, method: str):
    """Every method, health and reflection included: typed errors mapped to their status, and
    requests that do not parse answered INVALID_ARGUMENT naming the method."""
    if handler is None:
        return None
    return rewrap_handler(handler, wrap, _decoding(handler.request_deserializer, method))


class ErrorInterceptor(grpc.ServerInterceptor):
    """Turns a TandemError raised by a servicer into its status code and message."""

    def intercept_service(self, continuation, handler_call_details):
        return _wrapped_handler(continuation(handler_call_details), _wrap_sync, handler_call_details.method)


class AioErrorInterceptor(grpc.aio.ServerInterceptor):
    async def intercept_service(self, continuation, handler_call_details):
        return _wrapped_handler(await continuation(handler_call_details), _wrap_aio, handler_call_details.method)


def _enable_reflection(server, names: list[str]) -> None:
    reflection.enable_server_reflection([*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)


def add_health_and_reflection(server: grpc.Server, service_names: Iterable[str]) -> health.HealthServicer:
    """Serves grpc.health.v1 (SERVING for "" and each service) and server reflection."""
    servicer = health.HealthServicer(experimental_non_blocking=True)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    names = list(service_names)
    for name in ["", *names]:
        servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    _enable_reflection(server, names)
    return servicer


async def add_health_and_reflection_aio(server: grpc.aio.Server, service_names: Iterable[str]) -> health_aio.HealthServicer:
    servicer = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    names = list(service_names)
    await set_health_aio(servicer, names, True)
    _enable_reflection(server, names)
    return servicer


async def set_health_aio(servicer: health_aio.HealthServicer, service_names: Iterable[str], serving: bool) -> None:
    """SERVING or NOT_SERVING for "" and each service."""
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ["", *service_names]:
        await servicer.set(name, status)


def serve_until_signal(server: grpc.Server, health_servicer: health.HealthServicer, name: str) -> None:
    """Blocks until SIGTERM or SIGINT, then reports NOT_SERVING and drains in-flight calls."""
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    log.info("%s: shutting down", name)
    health_servicer.enter_graceful_shutdown()
    server.stop(GRACE_SECONDS).wait()
