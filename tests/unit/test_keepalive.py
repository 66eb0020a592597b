"""Long-lived streams survive keepalive pings while idle: a real gRPC server built with the
services' SERVER_OPTIONS and a client with CHANNEL_OPTIONS, both with the keepalive interval
scaled down 100x so a few seconds hold many pings. A server left at gRPC's default minimum ping
interval (5 minutes) drops such a stream with "Too many pings"."""

import queue
import time
from concurrent import futures

import grpc

from tandem.grpc_server import CHANNEL_OPTIONS, KEEPALIVE_MS, SERVER_OPTIONS

SCALE = 100
KEEPALIVE_ARGS = {"grpc.keepalive_time_ms", "grpc.http2.min_ping_interval_without_data_ms"}


def scaled(options: list[tuple]) -> list[tuple]:
    return [(k, v // SCALE if k in KEEPALIVE_ARGS else v) for k, v in options]


def echo(requests, context):
    yield from requests


def test_an_idle_stream_outlives_many_keepalive_pings():
    handler = grpc.method_handlers_generic_handler("t.Echo", {"Stream": grpc.stream_stream_rpc_method_handler(echo)})
    server = grpc.server(futures.ThreadPoolExecutor(2), options=scaled(SERVER_OPTIONS))
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    # Clients in other languages keep pinging an idle stream; so does this one.
    options = [*scaled(CHANNEL_OPTIONS), ("grpc.http2.max_pings_without_data", 0)]
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}", options=options) as channel:
            outgoing: queue.Queue = queue.Queue()
            stream = channel.stream_stream("/t.Echo/Stream")(iter(outgoing.get, None))
            outgoing.put(b"first")
            assert next(stream) == b"first"
            time.sleep(40 * KEEPALIVE_MS / SCALE / 1000)  # idle through 40 pings
            outgoing.put(b"after")
            assert next(stream) == b"after"
            outgoing.put(None)
            assert list(stream) == []
    finally:
        server.stop(None)
