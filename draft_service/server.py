"""Builds and runs the draft service: the gRPC server plus its peer stream to the target."""

import logging
import threading
from collections.abc import Callable

import torch
from grpc_health.v1 import health_pb2

from draft_service.config import DraftConfig
from draft_service.methods import DraftMethod, draft_method
from draft_service.peer_client import DraftPeer
from draft_service.protocol import DraftEngine
from draft_service.servicer import SERVICE_NAME, DraftServicer
from tandem.channels import bind, make_server
from tandem.compute import compute_thread
from tandem.grpc_server import add_health_and_reflection, serve_until_signal
from tandem.security.identity import draft_policy
from tandem.metrics import engine_collector, serve_metrics
from tandem.probes import Sidecars, start_probes
from tandem.telemetry.tracing import Tracing, setup_tracing
from tandem.v1 import engine_pb2_grpc

log = logging.getLogger(__name__)


def build_engine(config: DraftConfig, peer, tracing: Tracing | None = None) -> tuple[object, DraftMethod]:
    """The method's head and engine; raises InvalidArgument for an unknown method."""
    method = draft_method(config.method)
    head = method.load(config.model_dir, config.target_model_dir, config.dtype, config.device,
                       config.lm_head_quant == "int8", config.head_quant == "int8", config.cpu_kernels)
    peer.use_columns(head.vocab_ids)  # before the peer starts: the first stream sends them
    peer.use_features(head.feature_layers, head.feature_width)
    engine = method.engine()(config, head, peer, tracing=tracing)
    if not isinstance(engine, DraftEngine):  # a new method's engine must answer what the servicer asks
        raise TypeError(f"draft method {config.method!r}: its engine is not a draft_service.protocol.DraftEngine")
    return engine, method


def follow_peer(health) -> Callable[[DraftPeer], None]:
    """The peer's on_connected: SERVING only while its stream to the target is open (without it
    the draft has no hidden states to draft from, and a router that saw it healthy would
    speculate into failures). Each call reads the state afresh under one lock, so the last
    status set is the current one."""
    lock = threading.Lock()

    def sync(peer: DraftPeer) -> None:
        with lock:
            serving = health_pb2.HealthCheckResponse.SERVING
            status = serving if peer.connected else health_pb2.HealthCheckResponse.NOT_SERVING
            for name in ("", SERVICE_NAME):
                health.set(name, status)

    return sync


def start_draft(config: DraftConfig, tracing: Tracing | None = None):
    """Starts the server and the peer stream; returns (server, health, bound port, engine,
    metrics server or None)."""
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    checks = [draft_policy(config.identities)] if config.tls.mutual else []
    server = make_server(checks=checks)
    health = add_health_and_reflection(server, [SERVICE_NAME])
    peer_health = follow_peer(health)
    peer = DraftPeer(config.target_address, config.device, config.tls, on_connected=peer_health)
    compute = compute_thread("draft-compute", config.num_threads or torch.get_num_threads())
    engine, kind = compute.submit(build_engine, config, peer, tracing).result()  # built where it computes
    peer.start()
    if not peer.wait_connected(config.hidden_timeout_s * 6):
        why = f": it refused it ({peer.refusal})" if peer.refusal else ""
        raise RuntimeError(f"draft: no peer stream to the target at {config.target_address}{why}")
    max_draft_tokens, shape = kind.describe(engine)
    servicer = DraftServicer(engine, config.method, config.model_dir.name, compute,
                             max_draft_tokens=max_draft_tokens, shape=shape, tracing=tracing)
    engine_pb2_grpc.add_DraftEngineServicer_to_server(servicer, server)
    peer_health(peer)
    port = bind(server, config.host, config.port, config.tls, "draft")
    server.start()
    probes = start_probes(health, config.host, config.health_port, "draft") if config.health_port else None
    log.info("draft: %s head %s (%s, up to %s drafts) on %s:%d, peer %s", config.method, config.model_dir, shape,
             max_draft_tokens or "k", config.host, port, config.target_address)
    metrics = serve_metrics(config.host, config.metrics_port, engine_collector("draft", engine), "draft")
    return server, health, port, engine, Sidecars.of(metrics, probes)


def run_draft(config: DraftConfig) -> None:
    tracing = setup_tracing("draft")
    server, health, _, engine, metrics = start_draft(config, tracing)
    serve_until_signal(server, health, "draft")
    if metrics:
        metrics.stop()
    engine.peer.stop()
    tracing.shutdown()  # exports the spans still queued
