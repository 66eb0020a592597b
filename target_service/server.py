"""Builds and runs the target service's gRPC server."""

import logging
from concurrent import futures

import grpc
import torch

from tandem.grpc_server import SERVER_OPTIONS, ErrorInterceptor, add_health_and_reflection, serve_until_signal
from tandem.metrics import engine_collector, serve_metrics
from tandem.telemetry.tracing import Tracing, setup_tracing
from tandem.v1 import engine_pb2_grpc
from target_service.config import TargetConfig
from target_service.engine import TargetEngine
from target_service.servicer import SERVICE_NAME, TargetServicer, compute_thread

log = logging.getLogger(__name__)


def start_target(config: TargetConfig, engine: TargetEngine | None = None, tracing: Tracing | None = None):
    """Starts the server (non-blocking); returns (server, health servicer, bound port, engine,
    metrics server or None)."""
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    compute = compute_thread("target-compute", config.num_threads or torch.get_num_threads())
    engine = engine or compute.submit(TargetEngine, config).result()  # built where it computes
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=8),
        interceptors=[ErrorInterceptor()],
        options=SERVER_OPTIONS,
    )
    engine_pb2_grpc.add_TargetEngineServicer_to_server(TargetServicer(engine, compute, tracing), server)
    health = add_health_and_reflection(server, [SERVICE_NAME])
    port = server.add_insecure_port(f"{config.host}:{config.port}")
    if port == 0:
        raise RuntimeError(f"target: cannot bind {config.host}:{config.port}")
    server.start()
    log.info("target: serving %s (%s) on %s:%d", config.model_dir, config.dtype, config.host, port)
    metrics = serve_metrics(config.host, config.metrics_port, engine_collector("target", engine), "target")
    return server, health, port, engine, metrics


def run_target(config: TargetConfig) -> None:
    tracing = setup_tracing("target")
    server, health, _, _, metrics = start_target(config, tracing=tracing)
    serve_until_signal(server, health, "target")
    if metrics:
        metrics.stop()
    tracing.shutdown()  # exports the spans still queued
