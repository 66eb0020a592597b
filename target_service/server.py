"""Builds and runs the target service's gRPC server."""

import logging

import torch

from tandem.channels import bind, make_server
from tandem.grpc_server import add_health_and_reflection, serve_until_signal
from tandem.security.identity import target_policy
from tandem.metrics import engine_collector, serve_metrics
from tandem.probes import Sidecars, start_probes
from tandem.telemetry.tracing import Tracing, setup_tracing
from tandem.v1 import engine_pb2_grpc
from target_service.config import TargetConfig
from target_service.engine import TargetEngine
from target_service.servicer import SERVICE_NAME, TargetServicer
from tandem.compute import compute_thread

log = logging.getLogger(__name__)


def start_target(config: TargetConfig, engine: TargetEngine | None = None, tracing: Tracing | None = None):
    """Starts the server (non-blocking); returns (server, health servicer, bound port, engine,
    side servers (tandem.probes.Sidecars: metrics, probe port) or None)."""
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    compute = compute_thread("target-compute", config.num_threads or torch.get_num_threads())
    engine = engine or compute.submit(TargetEngine, config).result()  # built where it computes
    checks = [target_policy(config.identities)] if config.tls.mutual else []
    server = make_server(checks=checks)
    engine_pb2_grpc.add_TargetEngineServicer_to_server(TargetServicer(engine, compute, tracing), server)
    health = add_health_and_reflection(server, [SERVICE_NAME])
    port = bind(server, config.host, config.port, config.tls, "target")
    server.start()
    probes = start_probes(health, config.host, config.health_port, "target") if config.health_port else None
    log.info("target: serving %s (%s) on %s:%d", config.model_dir, config.dtype, config.host, port)
    metrics = serve_metrics(config.host, config.metrics_port, engine_collector("target", engine), "target")
    return server, health, port, engine, Sidecars.of(metrics, probes)


def run_target(config: TargetConfig) -> None:
    tracing = setup_tracing("target")
    server, health, _, _, metrics = start_target(config, tracing=tracing)
    serve_until_signal(server, health, "target")
    if metrics:
        metrics.stop()
    tracing.shutdown()  # exports the spans still queued
