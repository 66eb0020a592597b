"""Scheduler: admission, chunked prefill, decode entries, limits and release, as literal plans."""

import pytest

from router.request import GenerationSpec, RequestState
from router.scheduler import Scheduler, SchedulerLimits, StepPlan
from tandem.errors import ResourceExhausted
from tandem.ops import AddSequence, EntryKind, RemoveSequence, StepEntry
from tandem.sampling.params import SamplingParams

GREEDY = SamplingParams(temperature=0.0)


def limits(**overrides) -> SchedulerLimits:
    values = dict(max_num_sequence=8, prefill_chunk_size=16, kv_pages_total=64, kv_page_size=4, max_waiting=16)
    values.update(overrides)
    return SchedulerLimits(**values)


def request(seq_id: int, prompt_len: int, max_tokens: int = 4, page_size: int = 4, pages: int | None = None) -> RequestState:
    """A request whose prompt tokens are seq_id * 100 + i, so every chunk names its owner."""
    spec = GenerationSpec(
        request_id=f"r{seq_id}",
        prompt_ids=tuple(seq_id * 100 + i for i in range(prompt_len)),
        sampler=GREEDY,
        max_tokens=max_tokens,
    )
    if pages is None:
        pages = -(-(prompt_len + max_tokens) // page_size)
    return RequestState(spec=spec, seq_id=seq_id, reserved_pages=pages)


def prefill(seq_id: int, start: int, stop: int, sample: bool) -> StepEntry:
    return StepEntry(seq_id, EntryKind.PREFILL, tuple(seq_id * 100 + i for i in range(start, stop)), sample)


def decode(seq_id: int, token: int) -> StepEntry:
    return StepEntry(seq_id, EntryKind.DECODE, (token,), True)


def test_empty_scheduler_plans_nothing():
    plan = Scheduler(limits()).schedule()
    assert plan == StepPlan(ops=(), entries=(), requests=())
    assert plan.empty


def test_admission_adds_the_sequence_and_prefills_with_sampling():
    sched = Scheduler(limits())
    state = request(1, prompt_len=5)
    sched.enqueue(state)
    assert not state.live and list(sched.waiting) == [state]
    plan = sched.schedule()
    assert plan.ops == (AddSequence(1, GREEDY),)
    assert plan.entries == (prefill(1, 0, 5, sample=True),)
    assert plan.requests == (state,)
    assert not plan.empty
    assert state.live and state.num_prefilled == 5 and state.prefill_left == 0
    assert sched.running == [state] and not sched.waiting
    assert sched.reserved_pages == state.reserved_pages == 3  # (5 + 4) tokens / 4
    # Nothing sampled yet: the next step has nothing to do.
    assert sched.schedule().empty


def test_pages_for_uses_the_page_size():
    sched = Scheduler(limits(kv_page_size=16))
    assert [sched.pages_for(n) for n in (0, 1, 16, 17, 33)] == [0, 1, 1, 2, 3]


def test_long_prompt_is_chunked_and_only_the_last_chunk_samples():
    sched = Scheduler(limits(prefill_chunk_size=4))
    state = request(1, prompt_len=10)
    sched.enqueue(state)
    first = sched.schedule()
    assert first.ops == (AddSequence(1, GREEDY),)
    assert first.entries == (prefill(1, 0, 4, sample=False),)
    second = sched.schedule()
    assert second.ops == ()  # added once only
    assert second.entries == (prefill(1, 4, 8, sample=False),)
    third = sched.schedule()
    assert third.entries == (prefill(1, 8, 10, sample=True),)
    assert third.requests == (state,)
    assert state.prefill_left == 0
    assert sched.schedule().empty


def test_prompt_of_exactly_the_chunk_size_is_one_sampled_chunk():
    sched = Scheduler(limits(prefill_chunk_size=4))
    sched.enqueue(request(1, prompt_len=4))
    assert sched.schedule().entries == (prefill(1, 0, 4, sample=True),)
    assert sched.schedule().empty


def test_prefill_budget_is_shared_across_requests_in_one_step():
    sched = Scheduler(limits(prefill_chunk_size=8))
    a, b, c = request(1, 5), request(2, 6), request(3, 2)
    for state in (a, b, c):
        sched.enqueue(state)
    plan = sched.schedule()
    # a takes 5, b gets the 3 left; c waits: no budget is left to start it.
    assert plan.ops == (AddSequence(1, GREEDY), AddSequence(2, GREEDY))
    assert plan.entries == (prefill(1, 0, 5, True), prefill(2, 0, 3, False))
    assert plan.requests == (a, b)
    assert list(sched.waiting) == [c] and not c.live
    # b's prefill in progress comes before new admissions.
    plan = sched.schedule()
    assert plan.ops == (AddSequence(3, GREEDY),)
    assert plan.entries == (prefill(2, 3, 6, True), prefill(3, 0, 2, True))
    assert plan.requests == (b, c)


def test_decode_entries_for_running_requests_with_a_pending_token():
    sched = Scheduler(limits())
    a, b = request(1, 3), request(2, 3)
    sched.enqueue(a)
    sched.enqueue(b)
    sched.schedule()
    a.pending_token = 42  # what the router's postprocess does with a sampled token
    plan = sched.schedule()
    assert plan.ops == ()
    assert plan.entries == (decode(1, 42),)
    assert plan.requests == (a,)
    assert a.pending_token is None  # consumed: it goes into the KV this step
    assert sched.schedule().empty
    a.pending_token, b.pending_token = 7, 8
    plan = sched.schedule()
    assert plan.entries == (decode(1, 7), decode(2, 8))
    assert plan.requests == (a, b)


def test_decodes_come_first_and_do_not_use_the_prefill_budget():
    sched = Scheduler(limits(prefill_chunk_size=4))
    a, b = request(1, 2), request(2, 6)
    sched.enqueue(a)
    assert sched.schedule().entries == (prefill(1, 0, 2, True),)
    sched.enqueue(b)
    a.pending_token = 5
    plan = sched.schedule()
    assert plan.ops == (AddSequence(2, GREEDY),)
    assert plan.entries == (decode(1, 5), prefill(2, 0, 4, False))
    assert plan.requests == (a, b)


def test_max_num_sequence_limits_admission_until_release():
    sched = Scheduler(limits(max_num_sequence=2))
    states = [request(i, 2) for i in (1, 2, 3)]
    for state in states:
        sched.enqueue(state)
    plan = sched.schedule()
    assert [e.seq_id for e in plan.entries] == [1, 2]
    assert list(sched.waiting) == [states[2]]
    assert sched.schedule().empty  # still full
    sched.release(states[0])
    plan = sched.schedule()
    assert plan.ops == (RemoveSequence(1), AddSequence(3, GREEDY))
    assert plan.entries == (prefill(3, 0, 2, True),)
    assert sched.running == [states[1], states[2]]


def test_kv_reservation_limits_admission_until_release():
    sched = Scheduler(limits(kv_pages_total=10))
    a, b, c = request(1, 2, pages=6), request(2, 2, pages=5), request(3, 2, pages=4)
    for state in (a, b, c):
        sched.enqueue(state)
    plan = sched.schedule()
    # b does not fit (6 + 5 > 10); c would, but admission is FIFO: it waits behind b.
    assert [e.seq_id for e in plan.entries] == [1]
    assert sched.reserved_pages == 6
    assert list(sched.waiting) == [b, c]
    sched.release(a)
    assert sched.reserved_pages == 0
    plan = sched.schedule()
    assert plan.ops == (RemoveSequence(1), AddSequence(2, GREEDY), AddSequence(3, GREEDY))
    assert sched.reserved_pages == 9
    assert sched.running == [b, c]


def test_a_request_that_fills_the_whole_cache_is_admitted_alone():
    sched = Scheduler(limits(kv_pages_total=4))
    a, b = request(1, 2, pages=4), request(2, 2, pages=1)
    sched.enqueue(a)
    sched.enqueue(b)
    assert [e.seq_id for e in sched.schedule().entries] == [1]
    sched.release(a)
    assert [e.seq_id for e in sched.schedule().entries] == [2]


def test_release_of_a_live_request_queues_remove_on_the_next_plan_only():
    sched = Scheduler(limits())
    state = request(1, 3)
    sched.enqueue(state)
    sched.schedule()
    state.pending_token = 9
    sched.release(state)
    assert not state.live and sched.running == [] and sched.reserved_pages == 0
    plan = sched.schedule()
    assert plan.ops == (RemoveSequence(1),)
    assert plan.entries == ()  # no decode for a released request
    assert not plan.empty
    assert sched.schedule().empty  # the remove is sent once
    sched.release(state)  # releasing twice is harmless
    assert sched.schedule().empty


def test_release_mid_prefill_stops_the_chunks():
    sched = Scheduler(limits(prefill_chunk_size=2))
    state = request(1, 6)
    sched.enqueue(state)
    sched.schedule()
    sched.release(state)
    plan = sched.schedule()
    assert plan.ops == (RemoveSequence(1),) and plan.entries == ()


def test_release_of_a_waiting_request_sends_nothing():
    sched = Scheduler(limits(max_num_sequence=1))
    a, b = request(1, 2), request(2, 2)
    sched.enqueue(a)
    sched.enqueue(b)
    sched.schedule()
    sched.release(b)
    assert not sched.waiting
    assert sched.schedule().empty
    sched.release(a)
    assert sched.schedule().ops == (RemoveSequence(1),)


def test_enqueue_rejects_a_request_that_can_never_fit():
    sched = Scheduler(limits(kv_pages_total=8))
    with pytest.raises(ResourceExhausted):
        sched.enqueue(request(1, 2, pages=9))
    assert not sched.waiting
    sched.enqueue(request(2, 2, pages=8))  # exactly the cache: accepted
    assert len(sched.waiting) == 1


def test_enqueue_rejects_beyond_max_waiting():
    sched = Scheduler(limits(max_waiting=2))
    sched.enqueue(request(1, 2))
    sched.enqueue(request(2, 2))
    with pytest.raises(ResourceExhausted):
        sched.enqueue(request(3, 2))
    assert [s.seq_id for s in sched.waiting] == [1, 2]
    sched.schedule()  # admission empties the queue: room again
    sched.enqueue(request(3, 2))
    assert [s.seq_id for s in sched.waiting] == [3]


def test_admission_is_fifo():
    sched = Scheduler(limits(max_num_sequence=2, prefill_chunk_size=100))
    states = [request(i, 3) for i in (5, 3, 9, 1)]
    for state in states:
        sched.enqueue(state)
    plan = sched.schedule()
    assert [op.seq_id for op in plan.ops] == [5, 3]
    assert [e.seq_id for e in plan.entries] == [5, 3]
    sched.release(states[1])
    sched.release(states[0])
    plan = sched.schedule()
    assert plan.ops == (RemoveSequence(3), RemoveSequence(5), AddSequence(9, GREEDY), AddSequence(1, GREEDY))
    assert [e.seq_id for e in plan.entries] == [9, 1]


def test_many_requests_drain_with_every_prompt_token_sent_once():
    sched = Scheduler(limits(max_num_sequence=3, prefill_chunk_size=5, kv_pages_total=12))
    states = [request(i, 3 + i) for i in range(1, 7)]
    for state in states:
        sched.enqueue(state)
    sent: dict[int, list[int]] = {s.seq_id: [] for s in states}
    sampled = []
    for _ in range(50):
        plan = sched.schedule()
        prefill_tokens = sum(len(e.token_ids) for e in plan.entries if e.kind is EntryKind.PREFILL)
        assert prefill_tokens <= 5
        assert len(sched.running) <= 3 and sched.reserved_pages <= 12
        for entry, state in zip(plan.entries, plan.requests):
            assert entry.seq_id == state.seq_id
            if entry.kind is EntryKind.PREFILL:
                sent[entry.seq_id].extend(entry.token_ids)
                assert entry.sample == (state.prefill_left == 0)
                if entry.sample:  # finish at once: release frees the slot for the next request
                    sampled.append(state.seq_id)
                    sched.release(state)
        if not sched.waiting and not sched.running:
            break
    assert sorted(sampled) == [s.seq_id for s in states]
    for state in states:
        assert tuple(sent[state.seq_id]) == state.spec.prompt_ids
