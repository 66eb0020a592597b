"""Builds and runs the draft service: the gRPC server plus its peer stream to the target."""

import logging
from concurrent import futures

import grpc
import torch

from draft_service.config import DraftConfig
from draft_service.engine import DraftEngine
from draft_service.methods import load_draft_head
from draft_service.peer_client import DraftPeer
from draft_service.servicer import SERVICE_NAME, DraftServicer
from tandem.grpc_server import SERVER_OPTIONS, ErrorInterceptor, add_health_and_reflection, serve_until_signal
from tandem.v1 import engine_pb2_grpc

log = logging.getLogger(__name__)


def start_draft(config: DraftConfig):
    """Starts the server and the peer stream; returns (server, health, bound port, engine)."""
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    head = load_draft_head(config.method, config.model_dir, config.target_model_dir, config.dtype, config.device)
    peer = DraftPeer(config.target_address, config.device)
    engine = DraftEngine(config, head, peer)
    peer.start()
    if not peer.wait_connected(config.hidden_timeout_s * 6):
        raise RuntimeError(f"draft: no peer stream to the target at {config.target_address}")
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), interceptors=[ErrorInterceptor()], options=SERVER_OPTIONS)
    servicer = DraftServicer(engine, config.method, config.model_dir.name, config.num_threads or torch.get_num_threads())
    engine_pb2_grpc.add_DraftEngineServicer_to_server(servicer, server)
    health = add_health_and_reflection(server, [SERVICE_NAME])
    port = server.add_insecure_port(f"{config.host}:{config.port}")
    if port == 0:
        raise RuntimeError(f"draft: cannot bind {config.host}:{config.port}")
    server.start()
    log.info("draft: %s head %s on %s:%d, peer %s", config.method, config.model_dir, config.host, port, config.target_address)
    return server, health, port, engine


def run_draft(config: DraftConfig) -> None:
    server, health, _, engine = start_draft(config)
    serve_until_signal(server, health, "draft")
    engine.peer.stop()
