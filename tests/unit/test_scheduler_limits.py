"""Scheduler and EngineLimits: requests refused at enqueue, the limits resolved from the router's
flags and the target's info, and a restarted target's limits adopted."""

from pathlib import Path

import pytest

from router.config import RouterConfig
from router.limits import EngineLimits, resolve_limits
from router.scheduler import Scheduler
from tandem.errors import InvalidArgument, ResourceExhausted
from tandem.ops import EngineInfo, EntryKind
from tests.unit.scheduler_helpers import limits, run, speculating, step, submit


# -- enqueue ----------------------------------------------------------------------------------


def test_enqueue_rejects_a_request_that_can_never_fit():
    sched = Scheduler(limits(kv_pages_total=8, max_total_sequence_length=30))
    with pytest.raises(ResourceExhausted):
        submit(sched, 1, 20, max_tokens=9)  # 29 tokens: 8 pages, and one more for a fork
    with pytest.raises(ResourceExhausted):
        submit(sched, 2, 20, max_tokens=11)  # 31 > max_total_sequence_length
    assert not sched.waiting
    submit(sched, 3, 20, max_tokens=8)  # 28 tokens: 7 pages + 1
    assert len(sched.waiting) == 1


def test_enqueue_rejects_beyond_max_waiting():
    sched = Scheduler(limits(max_waiting=2))
    submit(sched, 1, 2)
    submit(sched, 2, 2)
    with pytest.raises(ResourceExhausted):
        submit(sched, 3, 2)
    assert [s.seq_id for s in sched.waiting] == [1, 2]
    sched.schedule()  # admission empties the queue: room again
    request = submit(sched, 4, 2)
    assert list(sched.waiting) == request.choices


# -- EngineLimits -----------------------------------------------------------------------------


@pytest.mark.parametrize("overrides", [
    dict(max_num_sequence=4, spec_draft_length=4),  # no sequence can run: each counts k + 1
    dict(max_num_sequence=0),
    dict(spec_draft_length=-1),
    dict(max_total_sequence_length=257),  # beyond the cache's 64 * 4 tokens
    dict(max_total_sequence_length=0),
    dict(prefix_cache_max_num_recycling_seqs=-2),
    dict(prefill_chunk_size=0),
    dict(max_held_sequences=0),
    dict(kv_pages_total=0),
    dict(max_waiting=0),
])
def test_inconsistent_limits_are_invalid(overrides):
    with pytest.raises(InvalidArgument):
        limits(**overrides)


def test_max_running_divides_the_sequence_budget_by_k_plus_one():
    assert limits(max_num_sequence=10, spec_draft_length=4).max_running == 2
    assert limits(max_num_sequence=5, spec_draft_length=4).max_running == 1
    assert limits(max_num_sequence=10, spec_draft_length=0).max_running == 10


INFO = EngineInfo(model="m", architecture="llama", vocab_size=128, max_context_length=512, kv_page_size=4,
                  kv_pages_total=64, max_num_sequence=32, dtype="bfloat16", hidden_size=16, sliding_window=8)


def config(**overrides) -> RouterConfig:
    return RouterConfig(model_dir=Path("unused"), **overrides)


def test_resolve_limits_takes_the_targets_values_by_default():
    assert resolve_limits(config(), INFO, None) == EngineLimits(
        max_num_sequence=32, max_held_sequences=32, max_total_sequence_length=256, prefill_chunk_size=512,
        spec_draft_length=0, prefix_cache_max_num_recycling_seqs=-1, kv_page_size=4, kv_pages_total=64,
        max_waiting=1024, sliding_window=8, max_context_length=512)


def test_resolve_limits_with_a_draft_service():
    got = resolve_limits(config(draft_address="d:1", spec_draft_length=4, max_num_sequence=20, kv_page_size=4,
                                max_total_sequence_length=100, prefix_cache_max_num_recycling_seqs=3), INFO, 16)
    assert (got.max_num_sequence, got.max_held_sequences, got.spec_draft_length, got.max_running) == (20, 16, 4, 4)
    assert (got.max_total_sequence_length, got.prefix_cache_max_num_recycling_seqs) == (100, 3)


def test_resolve_limits_rejects_a_page_size_other_than_the_targets():
    with pytest.raises(InvalidArgument, match="kv_page_size"):
        resolve_limits(config(kv_page_size=8), INFO, None)


def test_resolve_limits_rejects_a_total_length_beyond_the_cache():
    with pytest.raises(InvalidArgument, match="max_total_sequence_length"):
        resolve_limits(config(max_total_sequence_length=257), INFO, None)


def test_a_negative_spec_disable_batch_size_is_refused_by_name():
    with pytest.raises(InvalidArgument, match="spec_disable_batch_size"):
        config(spec_disable_batch_size=-1)


def test_a_step_decoding_spec_disable_batch_size_sequences_drafts_nothing_and_reserves_no_pages_for_drafts():
    sched = Scheduler(limits(spec_draft_length=3, max_num_sequence=16, spec_disable_batch_size=2), speculating)
    first, second = submit(sched, 1, 4, max_tokens=8), submit(sched, 2, 4, max_tokens=8)
    assert not step(sched).drafts_paused  # prefills only
    plan = sched.schedule()
    assert plan.drafts_paused and [e.kind for e in plan.entries] == [EntryKind.DECODE] * 2
    assert [sched.draft_cap(r.choices[0]) for r in (first, second)] == [0, 0]
    assert first.choices[0].draft_live and second.choices[0].draft_live
    run(sched, plan)
    sched.finish(second.choices[0])
    alone = sched.schedule()
    assert not alone.drafts_paused and sched.draft_cap(first.choices[0]) == 3



def test_a_restarted_targets_limits_are_adopted_and_waiting_requests_that_never_fit_them_are_named():
    sched = Scheduler(limits(max_num_sequence=1))
    first = submit(sched, 1, 4, max_tokens=8)
    large = submit(sched, 2, 60, max_tokens=60, n=2)  # 120 tokens: waits behind first
    small = submit(sched, 3, 4, max_tokens=8)
    step(sched)
    assert first.choices[0].live and [s.request for s in sched.waiting] == [large, small]
    sched.release(first)
    sched.reset()
    smaller = limits(max_num_sequence=1, kv_pages_total=16, max_total_sequence_length=64)
    doomed = sched.adopt(smaller)
    assert [r for r, _ in doomed] == [large] and "120 tokens can never fit" in doomed[0][1]
    assert sched.kv.free_pages == 16 and sched.limits is smaller
    for request, _ in doomed:
        sched.release(request)
    step(sched)
    assert small.choices[0].live and small.choices[0].output_ids and not sched.waiting
