"""Builds and runs the router: connects to the target, then serves the public API (gRPC, and
the OpenAI-compatible HTTP API on --http-port)."""

import asyncio
import logging
import signal
from dataclasses import dataclass

from router.config import RouterConfig
from router.engine import RouterEngine, Wake
from router.figures import snapshot
from router.http.app import HttpApi, served_model_name
from router.http.tls import server_ssl_context
from router.metrics import router_families
from router.lookup import LookupConfig, LookupDrafter
from router.speculation import Speculator
from router.target_link import TargetLink
from router.servicer import SERVICE_NAME, GenerationServicer
from router.tokenizer import Tokenizer
from tandem.channels import RenewableChannel, bind, make_server, public_server_options
from tandem.grpc_server import add_health_and_reflection_aio, set_health_aio
from tandem.security.api_keys import ApiKeys
from tandem.metrics import serve_metrics
from tandem.probes import Sidecars, start_probes_aio
from tandem.telemetry.tracing import Tracing, setup_tracing
from tandem.v1 import generate_pb2_grpc

log = logging.getLogger(__name__)


@dataclass
class PublicServers:
    """The router's public ports, stopped together: gRPC, and HTTP (None: --http-port 0)."""

    grpc: object  # grpc.aio.Server
    http: HttpApi | None = None

    async def stop(self, grace_s: float | None) -> None:
        await asyncio.gather(self.grpc.stop(grace_s), *([self.http.stop()] if self.http else []))


async def start_router(config: RouterConfig, tracing: Tracing | None = None):
    """Starts the router; returns (PublicServers, engine, health, channel, bound gRPC port, side
    servers (tandem.probes.Sidecars: metrics, probe port) or None)."""
    wake = Wake()  # the engine's; the target link rings it when its step stream ends
    target, reset = await TargetLink.connect(config.target_address, config.tls, config.connect_timeout_s,
                                             config.step_timeout_s, on_stream_end=wake.ring)
    info = reset.info
    speculator = None
    if config.draft_address:
        speculator = Speculator(RenewableChannel(config.draft_address, config.tls), config.spec_draft_length, config.draft_timeout_s, info.vocab_size,
                                config.draft_probe_s)
        await speculator.connect(config.connect_timeout_s)
    if config.local_draft:
        speculator = LookupDrafter(LookupConfig(config.local_draft, config.spec_draft_length, config.ngram_min_n,
                                                config.ngram_max_n, config.suffix_depth, config.suffix_cache_tokens))
    draft_max = speculator.max_sequences if speculator and speculator.max_sequences else None
    api_keys = ApiKeys(config.api_key_file) if config.api_key_file else None
    checks = [api_keys] if api_keys else []
    options = public_server_options(config.max_connection_age_s, config.max_connection_age_grace_s,
                                    config.min_ping_interval_s)
    server = make_server(aio=True, checks=checks, options=options, maximum_concurrent_rpcs=config.max_concurrent_rpcs or None)
    health = await add_health_and_reflection_aio(server, [SERVICE_NAME])
    # NOT_SERVING while the target is down or serves another model: no request could be served.
    engine = RouterEngine(config, Tokenizer(config.model_dir), target, info, speculator,
                          first_step_id=reset.last_step_id + 1, draft_max_num_sequence=draft_max, tracing=tracing,
                          wake=wake, on_serving=lambda serving: set_health_aio(health, [SERVICE_NAME], serving))
    engine.start()
    generate_pb2_grpc.add_GenerationServicer_to_server(GenerationServicer(engine), server)
    await set_health_aio(health, [SERVICE_NAME], engine.serving)  # it may have changed since start()
    port = bind(server, config.host, config.port, config.public_tls, "router", internal=False)
    # HTTP first: once the gRPC port answers health checks (tandem up, compose), both serve.
    http = await _start_http(config, engine, api_keys) if config.http_port else None
    await server.start()
    probes = await start_probes_aio(health, config.host, config.health_port, "router") if config.health_port else None
    log.info("router: serving on %s:%d, target %s (%s)", config.host, port, config.target_address, info.model)
    metrics = serve_metrics(config.host, config.metrics_port, lambda: router_families(snapshot(engine)), "router")
    return PublicServers(server, http), engine, health, target.channel, port, Sidecars.of(metrics, probes)


async def _start_http(config: RouterConfig, engine: RouterEngine, api_keys: ApiKeys | None) -> HttpApi:
    http = HttpApi(engine, api_keys, served_model_name(config.model_dir, config.served_model_name))
    port = await http.start(config.host, config.http_port, server_ssl_context(config.public_tls))
    scheme = "https" if config.public_tls.serves_tls else "http"
    log.info("router: OpenAI-compatible API on %s://%s:%d/v1 (model %r)", scheme, config.host, port, http.model_name)
    return http


CANCEL_MARGIN_S = 1.0  # of the grace period: time to send the cancelled deltas and close


async def _serve(config: RouterConfig, tracing: Tracing | None = None) -> None:
    server, engine, health, _, _, sidecars = await start_router(config, tracing)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await drain(server, engine, health, config.shutdown_grace_s)
    if sidecars:
        await sidecars.astop()


async def drain(server: PublicServers, engine: RouterEngine, health, grace_s: float) -> None:
    """Health NOT_SERVING first (load balancers and probes stop sending; HTTP /health 503), new
    requests refused UNAVAILABLE (HTTP 503) while the ports stay open, running ones given the
    grace period to finish; those still live then end as "cancelled", with their usage; then
    the servers and the engine stop."""
    log.info("router: draining (up to %.0f s for %d live requests)", grace_s, engine.live_requests)
    await health.enter_graceful_shutdown()
    engine.begin_drain()
    if not await engine.drained(max(grace_s - CANCEL_MARGIN_S, 0)):
        log.warning("router: the grace period ended with requests live; they end cancelled")
    engine.cancel_all()
    await server.stop(CANCEL_MARGIN_S)
    await engine.stop()  # closes its channel to the target
    log.info("router: stopped")


def run_router(config: RouterConfig) -> None:
    tracing = setup_tracing("router")
    try:
        asyncio.run(_serve(config, tracing))
    finally:
        tracing.shutdown()  # exports the spans still queued
