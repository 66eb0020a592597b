"""The public Generation servicer: protobuf in, router engine, protobuf out."""

import asyncio

from router import convert
from router.engine import RouterEngine
from router.speculation import SpecStats
from tandem.errors import TandemError
from tandem.v1 import generate_pb2 as pb
from tandem.v1 import generate_pb2_grpc


class GenerationServicer(generate_pb2_grpc.GenerationServicer):
    def __init__(self, engine: RouterEngine):
        self.engine = engine

    async def Generate(self, request, context):
        engine = self.engine
        spec = convert.spec_from_pb(
            request,
            engine.tokenizer,
            vocab_size=engine.info.vocab_size,
            max_context=engine.info.max_context_length,
            default_max_tokens=engine.config.default_max_tokens,
        )
        request = engine.submit(spec)
        want_logprobs = spec.sampler.logprobs
        try:
            while True:
                item = await request.queue.get()
                if isinstance(item, TandemError):
                    raise item
                response = convert.delta_to_pb(spec.request_id, item, engine.tokenizer, want_logprobs)
                done = request.finished and request.queue.empty()
                if done:
                    response.usage.CopyFrom(convert.usage_to_pb(request))
                yield response
                if done:
                    return
        except asyncio.CancelledError:
            raise  # the client went away; finally frees the sequences
        finally:
            if not request.finished:
                engine.cancel(request)

    async def Tokenize(self, request, context):
        ids = convert.prompt_ids(request, self.engine.tokenizer, self.engine.info.vocab_size)
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
        e = self.engine
        c = e.counters
        spec = e.speculator.stats if e.speculator else SpecStats()
        return pb.StatsResponse(
            requests_total=c.requests_total,
            requests_running=len(e.scheduler.running),
            requests_waiting=len(e.scheduler.waiting),
            cached_prompt_tokens_total=c.cached_prompt_tokens_total,
            sequences_recycled=e.scheduler.kv.cache.num_recycled(),
            preemptions_total=e.scheduler.preempted_total,
            prompt_tokens_total=c.prompt_tokens_total,
            completion_tokens_total=c.completion_tokens_total,
            steps_total=c.steps_total,
            kv_pages_total=e.info.kv_pages_total,
            kv_pages_free=e.kv_pages_free,
            sequences_live=e.scheduler.kv.held,
            draft_tokens_total=spec.draft_tokens,
            accepted_draft_tokens_total=spec.accepted_tokens,
            mean_accepted_length=spec.mean_accepted_length,
            acceptance_by_position=spec.acceptance_by_position(),
            speculation_active=bool(e.speculator and e.speculator.healthy),
            step_ms_total=c.step_ms_total,
            target_compute_ms_total=c.target_compute_ms_total,
            draft_ms_total=spec.draft_ms,
            draft_compute_ms_total=spec.draft_compute_ms,
        )


SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name
