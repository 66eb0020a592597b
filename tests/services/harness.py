"""Runs a real target server and a real router server in this process, on loopback ports."""

import asyncio
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

import grpc

from draft_service.config import DraftConfig
from draft_service.server import start_draft
from router.config import RouterConfig
from router.server import start_router
from tandem.channels import open_channel
from tandem.security.tls import PLAINTEXT, TlsConfig
from tandem.v1 import engine_pb2, engine_pb2_grpc, generate_pb2, generate_pb2_grpc
from target_service.config import TargetConfig
from target_service.server import start_target


@dataclass
class Services:
    target_port: int
    router_port: int
    target_server: grpc.Server
    target_engine: object
    loop: asyncio.AbstractEventLoop
    thread: threading.Thread
    router_server: object
    router_engine: object
    channel: grpc.Channel
    draft_server: grpc.Server | None = None
    draft_engine: object = None
    draft_port: int = 0
    metrics: list = field(default_factory=list)  # the services' /metrics servers (metrics_port set)
    router_tls: TlsConfig = PLAINTEXT  # the router's identity: what target_stats calls with

    @property
    def stub(self) -> generate_pb2_grpc.GenerationStub:
        return generate_pb2_grpc.GenerationStub(self.channel)

    def target_stats(self):
        with open_channel(f"127.0.0.1:{self.target_port}", self.router_tls) as ch:
            return engine_pb2_grpc.TargetEngineStub(ch).Stats(engine_pb2.EngineStatsRequest(), timeout=10)

    def flush_prefix_cache(self) -> None:
        """Evicts the router's recycled sequences (their removes ride on the next step)."""
        self.loop.call_soon_threadsafe(self.router_engine.flush_prefix_cache)

    def wait_idle(self, timeout: float = 10.0):
        """Target stats once the router has flushed its prefix cache and sent its last removes
        (they ride on the next step)."""
        self.flush_prefix_cache()
        deadline = time.monotonic() + timeout
        while True:
            stats = self.target_stats()
            idle = stats.sequences_live == 0 and stats.kv_pages_free == stats.kv_pages_total
            if idle or time.monotonic() > deadline:
                return stats
            time.sleep(0.05)

    def stop_draft(self) -> None:
        """Kills the draft service (its server and its peer stream), as a crash would."""
        if self.draft_server is not None:
            self.draft_engine.peer.stop()
            self.draft_server.stop(0).wait()
            self.draft_server = None

    def stop(self) -> None:
        self.stop_draft()
        self.channel.close()
        asyncio.run_coroutine_threadsafe(self._stop_router(), self.loop).result(timeout=30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=30)
        self.target_server.stop(0).wait()
        for m in self.metrics:
            m.stop()

    async def _stop_router(self):
        await self.router_server.stop(0)
        await self.router_engine.stop()


def identity_tls(certs: Path | None, name: str) -> TlsConfig:
    """`name`'s certificate, key and the CA of a `tandem certs create` folder (None: plaintext)."""
    if certs is None:
        return PLAINTEXT
    return TlsConfig.of_identity(certs, name)


def start_services(
    model_dir: Path, *, target: dict | None = None, router: dict | None = None, draft_model: Path | None = None,
    draft_method: str = "eagle", draft: dict | None = None, tracing: dict | None = None, certs: Path | None = None,
) -> Services:
    """draft_model: a draft head folder for `draft_method`; `draft` overrides DraftConfig fields
    (shape, medusa_choices, ...); `tracing`: "router" / "target" / "draft" -> its Tracing;
    `certs`: a `tandem certs create` folder: mutual TLS between the services, TLS on the public
    port (the harness's channel verifies it against the CA)."""
    tracing = tracing or {}
    if certs is not None:
        target = {"tls": identity_tls(certs, "target"), **(target or {})}
        draft = {"tls": identity_tls(certs, "draft"), **(draft or {})}
        public = TlsConfig.of_identity(certs, "router", trust=False)
        router = {"tls": identity_tls(certs, "router"), "public_tls": public, **(router or {})}
    tconf = replace(TargetConfig(model_dir=model_dir, port=0, kv_cache_tokens=8192, kv_page_size=8), **(target or {}))
    target_server, _, target_port, engine, target_metrics = start_target(tconf, tracing=tracing.get("target"))
    draft_server, draft_engine, draft_port, draft_metrics = None, None, 0, None
    if draft_model is not None:
        dconf = DraftConfig(method=draft_method, model_dir=draft_model, target_model_dir=model_dir,
                            target_address=f"127.0.0.1:{target_port}", port=0, kv_cache_tokens=8192, kv_page_size=8)
        dconf = replace(dconf, **(draft or {}))
        draft_server, _, draft_port, draft_engine, draft_metrics = start_draft(dconf, tracing.get("draft"))
        router = {"draft_address": f"127.0.0.1:{draft_port}", **(router or {})}
    rconf = replace(
        RouterConfig(model_dir=model_dir, target_address=f"127.0.0.1:{target_port}", port=0, connect_timeout_s=30),
        **(router or {}),
    )
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    server, router_engine, _, _, router_port, router_metrics = asyncio.run_coroutine_threadsafe(
        start_router(rconf, tracing.get("router")), loop).result(timeout=60)
    channel = open_channel(f"127.0.0.1:{router_port}", TlsConfig(ca=certs / "ca.pem") if certs else PLAINTEXT)
    metrics = [m for m in (router_metrics, draft_metrics, target_metrics) if m is not None]
    return Services(target_port, router_port, target_server, engine, loop, thread, server, router_engine, channel,
                    draft_server, draft_engine, draft_port, metrics, identity_tls(certs, "router"))


def generate(stub, timeout: float = 120, **fields) -> tuple[list[int], str, list, generate_pb2.GenerateResponse]:
    """Runs one Generate stream; returns (token ids, text, responses, last response)."""
    params = fields.pop("params", None) or generate_pb2.SamplingParams()
    responses = list(stub.Generate(generate_pb2.GenerateRequest(params=params, **fields), timeout=timeout))
    ids = [t for r in responses for c in r.choices for t in c.token_ids]
    text = "".join(c.text for r in responses for c in r.choices)
    return ids, text, responses, responses[-1]


@contextmanager
def peer_stream(target_port: int, messages):
    """The draft's end of the target's Peer stream, by hand: sends `messages`, then stays open
    until the block ends; the block starts once the target's hello came."""
    done = threading.Event()

    def draft_side():
        yield from messages
        done.wait(30)

    try:
        with grpc.insecure_channel(f"127.0.0.1:{target_port}") as ch:
            stream = engine_pb2_grpc.TargetEngineStub(ch).Peer(draft_side())
            next(stream)  # the target's hello
            yield
            done.set()
            stream.cancel()
    finally:
        done.set()
