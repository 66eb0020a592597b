"""A router that goes away (killed, its host lost) and never comes back: the target and the draft
drop its sequences when its streams end, so their KV pages return without a reset."""

import asyncio
import time

import grpc

from tandem.channels import open_channel
from tandem.models.eagle_io import random_eagle_checkpoint
from tandem.testing.tiny import TINY_PROMPTS
from tandem.v1 import engine_pb2, engine_pb2_grpc
from tandem.v1 import generate_pb2 as pb
from tests import reliability
from tests.services.harness import generate, start_services


def _stats(port: int, stub_class):
    with open_channel(f"127.0.0.1:{port}") as channel:
        return stub_class(channel).Stats(engine_pb2.EngineStatsRequest(), timeout=10)


def _wait(predicate, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_a_router_gone_for_good_leaves_no_sequence_behind(tiny_model, tmp_path):
    head = random_eagle_checkpoint(tmp_path / "head", tiny_model, seed=4)
    s = start_services(tiny_model, draft_model=head, router={"spec_draft_length": 3})
    try:
        params = pb.SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
        for prompt in TINY_PROMPTS[:3]:  # finished sequences stay recycled in the prefix cache
            generate(s.stub, prompt=prompt, params=params)
        held = _stats(s.target_port, engine_pb2_grpc.TargetEngineStub)
        assert held.sequences_live > 0 and held.kv_pages_free < held.kv_pages_total
        assert _stats(s.draft_port, engine_pb2_grpc.DraftEngineStub).sequences_live > 0
        # the router goes away without a word (no reset, no removes): its channels close
        s.channel.close()
        asyncio.run_coroutine_threadsafe(s._stop_router(), s.loop).result(timeout=30)
        for port, stub in ((s.target_port, engine_pb2_grpc.TargetEngineStub),
                           (s.draft_port, engine_pb2_grpc.DraftEngineStub)):
            freed = _wait(lambda: (st := _stats(port, stub)).sequences_live == 0 and st.kv_pages_free == st.kv_pages_total)
            if not freed:
                reliability.leaks()
            assert freed, _stats(port, stub)
        reliability.faults()
    finally:
        s.loop.call_soon_threadsafe(s.loop.stop)
        s.thread.join(timeout=30)
        s.stop_draft()
        s.target_server.stop(0).wait()


def test_a_step_stream_that_ends_is_followed_by_a_reset(tiny_model):
    """The router reopens its step stream after it ended (the target dropped the router's
    sequences with it): it resets its view too, so a prompt that matched a recycled sequence is
    served from scratch, not from a sequence the target no longer holds."""
    s = start_services(tiny_model)
    try:
        params = pb.SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
        first = generate(s.stub, prompt=TINY_PROMPTS[0], params=params)[0]
        assert s.target_stats().sequences_live > 0  # recycled
        s.loop.call_soon_threadsafe(s.router_engine.target._steps.close)  # as a timed-out call would
        assert _wait(lambda: s.target_stats().sequences_live == 0)
        again = generate(s.stub, prompt=TINY_PROMPTS[0], params=params)
        assert again[0] == first and again[3].usage.cached_prompt_tokens == 0
    finally:
        s.stop()
