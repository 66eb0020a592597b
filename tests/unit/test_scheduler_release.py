"""Scheduler: preemption when the KV cache runs out, release of requests (cancelled, failed) and
the prefix cache's flush, as literal plans; nothing may stay held."""

from router.scheduler import Scheduler
from router.step_plan import StepPlan
from tandem.ops import AddSequence, EntryKind, EntryResult, RemoveSequence, SampledToken
from tests.unit.scheduler_helpers import (FIRST, GREEDY, SEEDED, assert_nothing_held, decode, finish, limits,
                                          prefill, prompt, run, speculating, step, submit)


# -- preemption -------------------------------------------------------------------------------


def test_decodes_that_do_not_fit_evict_recycled_then_preempt_the_newest_sequence():
    # 6 pages of 4 tokens; sequences of 4 prompt tokens cross a page every 4 decodes.
    sched = Scheduler(limits(max_num_sequence=2, kv_pages_total=6, max_total_sequence_length=24))
    r1 = submit(sched, 1, 4, max_tokens=12)
    step(sched)
    finish(sched, r1.choices[0])  # recycled: holds a page
    a, b, c = (submit(sched, tag, 4, max_tokens=12).choices[0] for tag in (2, 3, 4))
    plan = step(sched)
    assert plan.ops == (AddSequence(2, GREEDY), AddSequence(3, GREEDY))
    assert list(sched.waiting) == [c]  # two running sequences: the budget is full
    for i in range(4):  # lengths 4 -> 8: one new page each, then none
        assert step(sched) == StepPlan((), (decode(2, FIRST + i), decode(3, FIRST + i)), (a, b))
    assert sched.kv.free_pages == 1
    plan = step(sched)  # 8 -> 9 needs two pages: the recycled sequence goes first
    assert plan == StepPlan((RemoveSequence(1),), (decode(2, FIRST + 4), decode(3, FIRST + 4)), (a, b))
    for i in range(5, 8):
        step(sched)
    assert sched.kv.free_pages == 0 and sched.preempted_total == 0
    plan = step(sched)  # 12 -> 13: nothing recycled is left; b, the newest, is preempted
    assert plan == StepPlan((RemoveSequence(3),), (decode(2, FIRST + 8),), (a,))
    assert sched.preempted_total == 1 and sched.running == [a]
    assert list(sched.waiting) == [b, c] and b.seq_id == 5 and not b.live
    outputs = tuple(range(FIRST, FIRST + 9))
    assert b.output_ids == list(outputs) and b.pending_token is None and b.num_prefilled == 0
    assert b.input_ids == prompt(3, 4) + outputs  # nothing streamed is lost or repeated
    finish(sched, a)
    plan = step(sched)  # a is recycled: evicted to resume b, which samples its next token
    assert plan.ops == (RemoveSequence(2), AddSequence(5, GREEDY, num_prompt_tokens=4))  # the rest is output
    assert plan.entries == (prefill(5, prompt(3, 4) + outputs, True),) and plan.seqs == (b,)
    assert b.output_ids == [*outputs, FIRST + 9] and b.pending_token == FIRST + 9
    assert b.request.cached_prompt_tokens == 0 and list(sched.waiting) == [c]
    finish(sched, b)
    plan = step(sched)
    assert plan.ops == (AddSequence(4, GREEDY),) and plan.entries == (prefill(4, prompt(4, 4), True),)
    finish(sched, c)
    sched.flush_prefix_cache()
    assert sched.schedule().ops == (RemoveSequence(5), RemoveSequence(4))
    assert sched.kv.evicted_total == 4
    assert_nothing_held(sched)


def test_a_prefill_chunk_that_does_not_fit_preempts_instead_of_overflowing_the_cache():
    sched = Scheduler(limits(prefill_chunk_size=8, kv_pages_total=6, max_total_sequence_length=24))
    a, b = (submit(sched, tag, 12).choices[0] for tag in (1, 2))
    assert step(sched).entries == (prefill(1, prompt(1, 8), False),)
    plan = step(sched)
    assert plan.ops == (AddSequence(2, GREEDY),)
    assert plan.entries == (prefill(1, prompt(1, 12)[8:], True), prefill(2, prompt(2, 4), False))
    # a's decode (one page) and b's next chunk of 8 (two pages) do not fit in 2 free pages.
    plan = step(sched)
    assert plan == StepPlan((RemoveSequence(2),), (decode(1, FIRST),), (a,))
    assert list(sched.waiting) == [b] and b.seq_id == 3 and b.input_ids == prompt(2, 12)
    finish(sched, a)
    plan = step(sched)
    assert plan.ops == (RemoveSequence(1), AddSequence(3, GREEDY))
    assert plan.entries == (prefill(3, prompt(2, 8), False),)


# -- release and flush ------------------------------------------------------------------------


def test_release_of_waiting_and_running_requests_removes_live_sequences_once():
    sched = Scheduler(limits(max_num_sequence=1))
    r1, r2 = submit(sched, 1, 3), submit(sched, 2, 3)
    step(sched)
    sched.release(r2)  # waiting: nothing to remove
    assert not sched.waiting
    assert step(sched) == StepPlan((), (decode(1, FIRST),), tuple(r1.choices))
    sched.release(r1)  # running, a token pending
    assert not r1.choices[0].live and sched.running == []
    assert sched.schedule() == StepPlan(ops=(RemoveSequence(1),), entries=(), seqs=())
    assert sched.schedule().empty  # the remove is sent once
    sched.release(r1)  # twice is harmless
    assert sched.schedule().empty
    assert_nothing_held(sched)


def test_release_mid_prefill_stops_the_chunks():
    sched = Scheduler(limits(prefill_chunk_size=2))
    request = submit(sched, 1, 6)
    step(sched)
    sched.release(request)
    assert sched.schedule() == StepPlan(ops=(RemoveSequence(1),), entries=(), seqs=())


def test_a_result_for_a_sequence_released_while_its_step_ran_is_ignored():
    sched = Scheduler(limits())
    request = submit(sched, 1, 5)
    plan = sched.schedule()
    sched.commit(plan)
    sched.release(request)
    sched.on_result(request.choices[0], plan.entries[0], EntryResult(1, (SampledToken(FIRST, 0.0),)))
    assert sched.schedule().ops == (RemoveSequence(1),)
    assert_nothing_held(sched)


def test_a_sequence_released_before_its_plan_is_committed_takes_no_slots():
    sched = Scheduler(limits())
    request = submit(sched, 1, 5)
    plan = sched.schedule()
    sched.release(request)  # cancelled while the step was drafted
    sched.commit(plan)  # the plan still adds it: the remove follows with the next step
    assert plan.ops == (AddSequence(1, GREEDY),) and sched.schedule().ops == (RemoveSequence(1),)
    assert_nothing_held(sched)


def test_release_of_a_tree_removes_the_parent_and_the_activated_children():
    sched = Scheduler(limits(prefill_chunk_size=2, spec_draft_length=1), speculating)
    request = submit(sched, 1, 3, n=3, sampler=SEEDED)
    step(sched)
    step(sched)  # children 2 and 3 forked, the third waits
    sched.release(request)
    plan = sched.schedule()
    removes = (RemoveSequence(1), RemoveSequence(2), RemoveSequence(3))
    assert plan == StepPlan(ops=removes, entries=(), seqs=(), draft_ops=removes)
    assert request.unactivated == [] and sched.forking == [] and sched.running == []
    assert not sched.draft.held
    assert_nothing_held(sched)


def test_release_after_a_choice_finished_keeps_its_recycled_sequence_until_a_flush():
    sched = Scheduler(limits())
    request = submit(sched, 1, 3, n=2, sampler=SEEDED)
    step(sched)
    step(sched)
    finish(sched, request.choices[0])
    sched.release(request)
    assert sched.schedule().ops == (RemoveSequence(3),)
    assert sched.kv.recycled_ids() == [2]
    sched.flush_prefix_cache()
    assert sched.schedule().ops == (RemoveSequence(2),)
    assert_nothing_held(sched)


def test_flush_prefix_cache_evicts_every_recycled_sequence():
    sched = Scheduler(limits())
    r1, r2, _ = submit(sched, 1, 3), submit(sched, 2, 3), submit(sched, 3, 3)
    step(sched)
    finish(sched, r2.choices[0])
    finish(sched, r1.choices[0])
    sched.flush_prefix_cache()
    plan = sched.schedule()
    assert plan.ops == (RemoveSequence(2), RemoveSequence(1))  # least recently recycled first
    assert plan.entries == (decode(3, FIRST),)
    assert sched.kv.held == 1
    sched.flush_prefix_cache()
    assert sched.schedule().ops == ()


def test_a_mixed_load_drains_within_the_limits_and_leaks_nothing():
    lim = limits(max_num_sequence=8, spec_draft_length=1, prefill_chunk_size=8, kv_pages_total=10,
                 max_total_sequence_length=40, max_held_sequences=6)
    sched = Scheduler(lim, speculating)
    requests = [submit(sched, tag, 3 + tag % 5, max_tokens=12 + tag % 4, n=1 + tag % 3, sampler=SEEDED,
                       speculate=tag % 2 == 0, same_as=tag % 3) for tag in range(9)]
    for _ in range(400):
        plan = sched.schedule()
        if plan.empty and not plan.draft_ops and not sched.waiting:
            break
        assert sum(len(e.token_ids) for e in plan.entries if e.kind is EntryKind.PREFILL) <= lim.prefill_chunk_size
        assert len(sched.running) <= lim.max_running and sched.kv.held <= lim.max_held_sequences
        run(sched, plan)  # raises if a step overflows the KV cache
        for seq in plan.seqs:
            if not seq.is_parent and seq.live and len(seq.output_ids) >= seq.spec.max_tokens:
                finish(sched, seq)
    assert all(r.finished for r in requests) and not sched.running and not sched.forking
    for request in requests:  # every choice got its tokens in order, none lost or repeated
        assert all(c.output_ids == list(range(FIRST, FIRST + request.spec.max_tokens)) for c in request.choices)
    # The load did exercise preemption, eviction and the prefix cache.
    assert sched.preempted_total > 0 and sched.kv.evicted_total > 0
    assert sched.kv.matched_tokens_total > 0
    sched.flush_prefix_cache()
    sched.schedule()
    assert_nothing_held(sched)
    assert not sched.draft.held
