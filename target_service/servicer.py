"""The TargetEngine gRPC servicer: protobuf in, engine call, protobuf out. Nothing else."""

import itertools
import logging
import queue
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import torch

from tandem import codec, peer_codec
from tandem.errors import InvalidArgument
from tandem.grpc_server import answer_each
from tandem.peer import DraftProbs, HiddenStep, TargetPeer, one_torch_thread
from tandem.telemetry.tracing import Tracing, ending, server_span
from tandem.v1 import engine_pb2, engine_pb2_grpc
from target_service.engine import TargetEngine
from target_service.tracing import STEP_SPAN, describe_step


class TargetServicer(engine_pb2_grpc.TargetEngineServicer):
    def __init__(self, engine: TargetEngine, compute: ThreadPoolExecutor, tracing: Tracing | None = None):
        self.engine = engine
        self.tracing = tracing or Tracing.off()
        self._compute = compute  # the thread that built the engine (compute_thread)

    def Info(self, request, context):
        return codec.info_to_pb(self.engine.info())

    def Step(self, request, context):
        return self._step(request, context.invocation_metadata() or ())

    def Steps(self, request_iterator, context):
        """The router's steps on one stream: a failed step answers with its error, and the
        stream goes on as a caller of Step would. Its end drops the router's sequences
        (tandem.router_streams): a router that died leaves no KV pages behind."""
        return answer_each(self.engine.router_streams.follow(request_iterator), lambda m: self._step(m, m.trace_context.items()),
                           lambda m, error: engine_pb2.StepResponse(step_id=m.step_id, error=error))

    def _step(self, request, trace_headers) -> engine_pb2.StepResponse:
        step = codec.step_request_from_pb(request)
        # A step the router did not trace is a root span only if it runs something.
        with ending(server_span(self.tracing, STEP_SPAN, trace_headers, root_ok=bool(step.entries))) as span:
            describe_step(span, step)
            result = self._compute.submit(self.engine.step, step, span).result()
            describe_step(span, step, result)
        return codec.step_result_to_pb(result)

    def Stats(self, request, context):
        return codec.stats_to_pb(self.engine.stats())

    def Reset(self, request, context):
        return codec.stats_to_pb(self.engine.reset())

    def Peer(self, request_iterator, context):
        """The draft's stream: hidden states out, draft probabilities in (on a reader thread)."""
        peer, config = self.engine.peer, self.engine.model.config
        try:
            first = next(request_iterator, None)  # the draft's hello: what to stream
        except grpc.RpcError:  # the draft went away first
            return
        if first is None:
            return
        layers = ()
        if first.HasField("hello"):
            try:
                layers = peer_codec.feature_layers_from_pb(first.hello, config.num_layers)
            except InvalidArgument as e:
                logging.getLogger(__name__).error("target: draft peer refused: %s", e)
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        out = peer.attach(layers)
        out.put(HiddenStep(self.engine.last_step_id, ()))  # hello: steps up to here are past
        logging.getLogger(__name__).info("target: draft peer connected, reading %s",
                                         f"the inputs of layers {list(layers)}" if layers else "final hidden states")
        messages = itertools.chain([first], request_iterator)
        threading.Thread(target=_read_probs, args=(peer, messages, out, config.vocab_size), daemon=True).start()
        try:
            while context.is_active():
                try:
                    item = out.get(timeout=1.0)
                except queue.Empty:
                    continue
                if item is TargetPeer.CLOSED:
                    return
                yield peer_codec.hidden_step_to_pb(item)
        finally:
            peer.detach(out)


def _read_probs(peer: TargetPeer, request_iterator, out: queue.Queue, vocab_size: int) -> None:
    one_torch_thread()
    columns = None  # the stream's, once the draft sent them
    try:
        for message in request_iterator:
            try:
                if message.HasField("columns"):
                    columns = _stream_columns(message)
                    if not message.seqs:
                        continue
                probs = peer_codec.draft_probs_from_pb(message, columns=columns, vocab_size=vocab_size)
            except InvalidArgument as e:  # the stream stays; that step verifies its drafts as top-k
                logging.getLogger(__name__).warning("target: draft step %d's probabilities dropped: %s",
                                                    message.draft_step_id, e)
                probs = DraftProbs(message.draft_step_id, {})  # no wait for rows that will not come
            peer.put_probs(probs)
    except grpc.RpcError:
        pass
    except InvalidArgument as e:  # an undecodable message: the call ends with its status, set by the interceptor
        logging.getLogger(__name__).warning("target: draft peer stream ended: %s", e)
    finally:
        peer.detach(out)
        out.put(TargetPeer.CLOSED)


def _stream_columns(message) -> torch.Tensor | None:
    """The draft's columns, or None when they are malformed (its rows on them are then dropped,
    and their steps verify as top-k)."""
    try:
        return peer_codec.columns_from_pb(message)
    except InvalidArgument as e:
        logging.getLogger(__name__).warning("target: draft columns dropped: %s", e)
        return None


SERVICE_NAME = engine_pb2.DESCRIPTOR.services_by_name["TargetEngine"].full_name
