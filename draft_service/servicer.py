"""The DraftEngine gRPC servicer: protobuf in, engine call, protobuf out."""

from concurrent.futures import ThreadPoolExecutor

from draft_service.protocol import DraftEngine
from draft_service.tracing import DRAFT_SPAN, describe_draft
from tandem import codec
from tandem.grpc_server import answer_each
from tandem.telemetry.tracing import Tracing, ending, server_span
from tandem.v1 import engine_pb2, engine_pb2_grpc


class DraftServicer(engine_pb2_grpc.DraftEngineServicer):
    """engine: any draft method's engine (draft_service.methods.DRAFT_METHODS)."""

    def __init__(self, engine: DraftEngine, method: str, model: str, compute: ThreadPoolExecutor, *, max_draft_tokens: int = 0,
                 shape: str = "chain", tracing: Tracing | None = None):
        self.engine = engine
        self.tracing = tracing or Tracing.off()
        self._compute = compute  # the thread that built the engine (tandem.compute.compute_thread)
        self.method = method
        self.model = model
        self.max_draft_tokens = max_draft_tokens  # 0: the router's k (an EAGLE chain)
        self.shape = shape

    def Info(self, request, context):
        head = self.engine.head
        return engine_pb2.DraftInfo(
            method=self.method, model=self.model, hidden_size=head.config.hidden_size,
            vocab_size=head.config.vocab_size, dtype=self.engine.config.dtype,
            max_num_sequence=self.engine.config.max_num_sequence,
            max_draft_tokens=self.max_draft_tokens, shape=self.shape,
        )

    def Draft(self, request, context):
        return self._draft(request, context.invocation_metadata() or ())

    def Drafts(self, request_iterator, context):
        """The router's calls on one stream: a failed one answers with its error, and the
        stream goes on. Its end drops the router's sequences (tandem.router_streams)."""
        return answer_each(self.engine.router_streams.follow(request_iterator), lambda m: self._draft(m, m.trace_context.items()),
                           lambda m, error: engine_pb2.DraftResponse(draft_step_id=m.draft_step_id, error=error))

    def _draft(self, message, trace_headers) -> engine_pb2.DraftResponse:
        request = codec.draft_request_from_pb(message)
        # An ops-only call the router did not trace is no trace of its own.
        with ending(server_span(self.tracing, DRAFT_SPAN, trace_headers, root_ok=bool(request.seqs))) as span:
            describe_draft(span, request)
            result = self._compute.submit(self.engine.draft, request, span).result()
            describe_draft(span, request, result)
        return codec.draft_result_to_pb(result)

    def Stats(self, request, context):
        return codec.stats_to_pb(self.engine.stats())

    def Reset(self, request, context):
        return codec.stats_to_pb(self.engine.reset())


SERVICE_NAME = engine_pb2.DESCRIPTOR.services_by_name["DraftEngine"].full_name
