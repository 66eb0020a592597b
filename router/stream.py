"""One public request from its protobuf form to its stream of deltas, shared by the gRPC
servicer and the OpenAI HTTP API: validation and tokenizing (convert.spec_from_pb, on a thread),
then the request's queue drained until every choice has finished."""

import asyncio
from collections.abc import AsyncIterator

from router import convert
from router.request import Delta, GenerationSpec, Request
from tandem.errors import TandemError
from tandem.v1 import generate_pb2 as pb


async def spec_of(engine, request: pb.GenerateRequest) -> GenerationSpec:
    """The validated request (InvalidArgument naming the field otherwise). In a thread: a prompt
    of megabytes takes seconds to tokenize, and the event loop streams every other request
    meanwhile (the Rust tokenizer encodes and decodes through shared references, so the
    detokenizers on the loop may run beside it)."""
    return await asyncio.to_thread(
        convert.spec_from_pb,
        request,
        engine.tokenizer,
        vocab_size=engine.info.vocab_size,
        max_context=engine.info.max_context_length,
        default_max_tokens=engine.config.default_max_tokens,
        max_sequence_tokens=engine.limits.max_sequence_tokens,
        limits=engine.config.request_limits,
    )


async def deltas(engine, request: Request) -> AsyncIterator[tuple[Delta, bool]]:
    """Yields (delta, last) for a submitted request until its last delta (every choice
    finished, nothing left queued); raises the TandemError that ends it early. A consumer that
    stops early (its client went away: cancelled, or this generator closed) cancels the request,
    which frees its sequences with the next step: close it with contextlib.aclosing."""
    try:
        while True:
            item = await request.queue.get()
            if isinstance(item, TandemError):
                raise item
            last = request.finished and request.queue.empty()
            yield item, last
            if last:
                return
    finally:
        if not request.finished:
            engine.cancel(request)
