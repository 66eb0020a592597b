"""A service's side servers: its plaintext probe port (--health-port) and its Prometheus
endpoint, stopped together.

The probe port is a server of its own, not a second port of the service's: it answers
grpc.health.v1 Check (what Kubernetes' gRPC probes and load balancers call) and nothing else,
from its own small thread pool with a cap on calls in flight. A flood of calls there, or
long-lived Watch streams, can neither reach the service's methods nor take the threads its
router and draft are served from; and the service's own caps (--max-concurrent-rpcs) never
refuse a probe."""

import asyncio
import logging
from concurrent import futures

import grpc
from grpc_health.v1 import health_pb2_grpc

log = logging.getLogger(__name__)
PROBE_THREADS = 2
PROBE_MAX_CALLS = 16  # in flight; more are refused RESOURCE_EXHAUSTED at once


class _CheckOnly(health_pb2_grpc.HealthServicer):
    """The service's health servicer's Check; Watch answers UNIMPLEMENTED (the base class)."""

    def __init__(self, health):
        self._health = health

    def Check(self, request, context):
        return self._health.Check(request, context)


class _AioCheckOnly(health_pb2_grpc.HealthServicer):
    def __init__(self, health):
        self._health = health

    async def Check(self, request, context):
        return await self._health.Check(request, context)


def _bind(server, host: str, port: int, name: str) -> None:
    if server.add_insecure_port(f"{host}:{port}") == 0:
        raise RuntimeError(f"{name}: cannot bind the health port {host}:{port}")
    log.info("%s: health probes (plaintext, Check only) on %s:%d", name, host, port)


def start_probes(health, host: str, port: int, name: str) -> grpc.Server:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=PROBE_THREADS), maximum_concurrent_rpcs=PROBE_MAX_CALLS)
    health_pb2_grpc.add_HealthServicer_to_server(_CheckOnly(health), server)
    _bind(server, host, port, name)
    server.start()
    return server


async def start_probes_aio(health, host: str, port: int, name: str) -> grpc.aio.Server:
    server = grpc.aio.server(maximum_concurrent_rpcs=PROBE_MAX_CALLS)
    health_pb2_grpc.add_HealthServicer_to_server(_AioCheckOnly(health), server)
    _bind(server, host, port, name)
    await server.start()
    return server


class Sidecars:
    """The side servers of one service (either may be None); stop() from any thread."""

    def __init__(self, metrics=None, probes=None):
        self.metrics, self.probes = metrics, probes
        self._loop = asyncio.get_running_loop() if isinstance(probes, grpc.aio.Server) else None

    @classmethod
    def of(cls, metrics=None, probes=None) -> "Sidecars | None":
        return cls(metrics, probes) if metrics or probes else None

    def stop(self) -> None:
        if self.metrics:
            self.metrics.stop()
        if self.probes is None:
            return
        if self._loop is None:
            self.probes.stop(0)
        elif _on_loop(self._loop):
            self._loop.create_task(self.probes.stop(0))
        else:
            asyncio.run_coroutine_threadsafe(self.probes.stop(0), self._loop).result(timeout=10)

    async def astop(self) -> None:
        """On the event loop of an aio probe server (the router's shutdown)."""
        if self.metrics:
            self.metrics.stop()
        if self.probes is not None:
            await self.probes.stop(0)


def _on_loop(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False
