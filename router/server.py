"""Builds and runs the router: connects to the target, then serves the public API."""

import asyncio
import logging
import signal

from router.config import RouterConfig
from router.engine import RouterEngine
from router.figures import snapshot
from router.metrics import router_families
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


async def start_router(config: RouterConfig, tracing: Tracing | None = None):
    """Starts the router; returns (server, engine, health, channel, bound port, side servers
    (tandem.probes.Sidecars: metrics, probe port) or None)."""
    target, reset = await TargetLink.connect(config.target_address, config.tls, config.connect_timeout_s,
                                             config.step_timeout_s)
    info = reset.info
    speculator = None
    if config.draft_address:
        speculator = Speculator(RenewableChannel(config.draft_address, config.tls), config.spec_draft_length, config.draft_timeout_s, info.vocab_size,
                                config.draft_probe_s)
        await speculator.connect(config.connect_timeout_s)
    draft_max = speculator.max_sequences if speculator and speculator.max_sequences else None
    engine = RouterEngine(config, Tokenizer(config.model_dir), target, info, speculator,
                          first_step_id=reset.last_step_id + 1, draft_max_num_sequence=draft_max, tracing=tracing)
    engine.start()
    checks = []
    if config.api_key_file:
        checks.append(ApiKeys(config.api_key_file))
    options = public_server_options(config.max_connection_age_s, config.max_connection_age_grace_s,
                                    config.min_ping_interval_s)
    server = make_server(aio=True, checks=checks, options=options, maximum_concurrent_rpcs=config.max_concurrent_rpcs or None)
    generate_pb2_grpc.add_GenerationServicer_to_server(GenerationServicer(engine), server)
    health = await add_health_and_reflection_aio(server, [SERVICE_NAME])
    # NOT_SERVING while the target is down or serves another model: no request could be served.
    engine.on_serving = lambda serving: set_health_aio(health, [SERVICE_NAME], serving)
    await set_health_aio(health, [SERVICE_NAME], engine.serving)  # it may have changed since start()
    port = bind(server, config.host, config.port, config.public_tls, "router", internal=False)
    await server.start()
    probes = await start_probes_aio(health, config.host, config.health_port, "router") if config.health_port else None
    log.info("router: serving on %s:%d, target %s (%s)", config.host, port, config.target_address, info.model)
    metrics = serve_metrics(config.host, config.metrics_port, lambda: router_families(snapshot(engine)), "router")
    return server, engine, health, target.channel, port, Sidecars.of(metrics, probes)


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


async def drain(server, engine: RouterEngine, health, grace_s: float) -> None:
    """Health NOT_SERVING first (load balancers and probes stop sending), new requests refused
    UNAVAILABLE while the port stays open, running ones given the grace period to finish; those
    still live then end as "cancelled", with their usage; then the server and the engine stop."""
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
