"""The public Generation servicer: protobuf in, router engine, protobuf out."""

import asyncio
import contextlib
import time

from router import convert, figures, stream
from router.engine import RouterEngine
from tandem.telemetry.tracing import ending
from tandem.v1 import generate_pb2 as pb
from tandem.v1 import generate_pb2_grpc


class GenerationServicer(generate_pb2_grpc.GenerationServicer):
    def __init__(self, engine: RouterEngine):
        self.engine = engine

    async def Generate(self, request, context):
        operation = "chat" if request.messages else "text_completion"
        span = self.engine.tracing.start_request(context.invocation_metadata(), operation)
        # aclosing: if this generator is closed rather than cancelled (the client gone while a
        # response was being sent), the inner one must run its finally (cancel the request, which
        # records its outcome on the span) before the span ends, not whenever it is collected.
        with ending(span):
            async with contextlib.aclosing(self._generate(request, span)) as responses:
                async for response in responses:
                    yield response

    async def _generate(self, request, span):
        arrived = time.monotonic()  # TTFT and duration count tokenizing (router.figures' clock)
        engine = self.engine
        span.add_event("start tokenize")
        spec = await stream.spec_of(engine, request)
        span.add_event("finish tokenize")
        submitted = engine.submit(spec, span, arrived)
        async with contextlib.aclosing(stream.deltas(engine, submitted)) as deltas:
            async for delta, last in deltas:
                response = convert.delta_to_pb(spec.request_id, delta, engine.tokenizer, spec.sampler.logprobs)
                if last:
                    response.usage.CopyFrom(convert.usage_to_pb(submitted))
                yield response

    async def Tokenize(self, request, context):
        engine = self.engine
        ids = await asyncio.to_thread(convert.prompt_ids, request, engine.tokenizer, engine.info.vocab_size,
                                      engine.config.request_limits)
        return pb.TokenizeResponse(token_ids=ids)

    async def ModelInfo(self, request, context):
        info = self.engine.info
        return pb.ModelInfoResponse(
            model=info.model,
            vocab_size=info.vocab_size,
            max_context_length=info.max_context_length,
            dtype=info.dtype,
            draft_method=self.engine.speculator.method or "unknown" if self.engine.speculator else "none",
            spec_draft_length=self.engine.speculator.k if self.engine.speculator else 0,
            eos_token_ids=sorted(self.engine.tokenizer.eos_token_ids),
        )

    async def Stats(self, request, context):
        return convert.stats_to_pb(figures.snapshot(self.engine))

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name
