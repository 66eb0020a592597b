"""A model service drops the router's sequences when the router's stream ends (the router went
away), unless a newer stream opened meanwhile (the router reconnected, and reset it)."""

import threading

import pytest
import torch

from tandem.ops import AddSequence, EntryKind, StepEntry, StepRequest
from tandem.router_streams import RouterStreams
from tandem.sampling.params import SamplingParams


class Service:
    def __init__(self):
        self.lock = threading.Lock()
        self.drops = 0
        self.streams = RouterStreams(self.lock, self.drop, "test")

    def drop(self):
        assert self.lock.locked()  # under the engine's lock: never beside a step
        self.drops += 1


def test_the_end_of_a_stream_drops_the_sequences_once_read_to_its_end():
    service = Service()
    assert list(service.streams.follow(iter([1, 2]))) == [1, 2]
    assert service.drops == 1


def test_a_stream_that_fails_drops_them_too():
    service = Service()

    def broken():
        yield 1
        raise ConnectionError("the router went away")

    with pytest.raises(ConnectionError):
        list(service.streams.follow(broken()))
    assert service.drops == 1


def test_an_old_stream_ending_after_a_newer_opened_drops_nothing():
    service = Service()
    old = service.streams.follow(iter([1]))
    assert next(old) == 1
    new = service.streams.follow(iter([2, 3]))
    assert next(new) == 2  # the router reconnected: this stream holds the sequences now
    assert list(old) == [] and service.drops == 0
    assert list(new) == [3] and service.drops == 1


def test_the_target_engine_returns_every_page_when_its_router_stream_ends(tmp_path):
    from target_service.config import TargetConfig
    from target_service.engine import TargetEngine
    from tandem.testing.tiny import build_tiny_model

    torch.manual_seed(0)
    engine = TargetEngine(TargetConfig(model_dir=build_tiny_model(tmp_path / "tiny"), kv_cache_tokens=256, kv_page_size=8))
    greedy = SamplingParams(temperature=0.0)
    steps = [StepRequest(step_id=i + 1, ops=(AddSequence(i + 1, greedy),),
                         entries=(StepEntry(i + 1, EntryKind.PREFILL, (5, 6, 7, 8, 9), True),)) for i in range(3)]
    for step in engine.router_streams.follow(iter(steps)):
        engine.step(step)
        assert engine.stats().sequences_live == step.step_id
    stats = engine.stats()
    assert stats.sequences_live == 0 and stats.kv_pages_free == stats.kv_pages_total
