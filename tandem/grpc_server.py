"""gRPC plumbing shared by the three services: message limits, the one interceptor that maps
typed errors to status codes, health, reflection and graceful shutdown."""

import logging
import signal
import threading
from collections.abc import Callable, Iterable, Iterator

import grpc
from grpc_health.v1 import _async as health_aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from tandem.errors import TandemError
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
GRACE_SECONDS = 5.0


def status_of(error: TandemError) -> grpc.StatusCode:
    return getattr(grpc.StatusCode, error.code, grpc.StatusCode.INTERNAL)


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


def _wrap_sync(behavior: Callable, streaming: bool) -> Callable:
    def unary(request, context):
        try:
            return behavior(request, context)
        except TandemError as e:
            context.abort(status_of(e), str(e))

    def stream(request, context):
        try:
            yield from behavior(request, context)
        except TandemError as e:
            context.abort(status_of(e), str(e))

    return stream if streaming else unary


def _wrap_aio(behavior: Callable, streaming: bool) -> Callable:
    async def unary(request, context):
        try:
            return await behavior(request, context)
        except TandemError as e:
            await context.abort(status_of(e), str(e))

    async def stream(request, context):
        try:
            async for item in behavior(request, context):
                yield item
        except TandemError as e:
            await context.abort(status_of(e), str(e))

    return stream if streaming else unary


def _wrapped_handler(handler, wrap):
    if handler is None or handler.request_streaming:
        return handler  # bidirectional streams handle their own errors
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(
            wrap(handler.unary_stream, True),
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )
    return grpc.unary_unary_rpc_method_handler(
        wrap(handler.unary_unary, False),
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


class ErrorInterceptor(grpc.ServerInterceptor):
    """Turns a TandemError raised by a servicer into its status code and message."""

    def intercept_service(self, continuation, handler_call_details):
        return _wrapped_handler(continuation(handler_call_details), _wrap_sync)


class AioErrorInterceptor(grpc.aio.ServerInterceptor):
    async def intercept_service(self, continuation, handler_call_details):
        return _wrapped_handler(await continuation(handler_call_details), _wrap_aio)


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
