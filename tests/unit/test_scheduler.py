"""Scheduler: admission, chunked prefill, decodes, the sequence budget, the prefix cache and
request trees (n > 1), as literal plans (helpers: tests/unit/scheduler_helpers.py)."""

from dataclasses import replace

from router.request import GenerationSpec, child_sampler, new_request
from router.scheduler import Scheduler
from router.step_plan import StepPlan
from tandem.ops import AddSequence, EntryResult, ForkSequence, RemoveSequence, SampledToken
from tests.unit.scheduler_helpers import (FIRST, GREEDY, SEEDED, decode, finish, limits, prefill, prompt, run,
                                          speculating, step, submit)


# -- admission, chunks, decodes ---------------------------------------------------------------


def test_empty_scheduler_plans_nothing():
    plan = Scheduler(limits()).schedule()
    assert plan == StepPlan(ops=(), entries=(), seqs=(), draft_ops=())
    assert plan.empty


def test_admission_adds_the_sequence_and_prefills_the_whole_prompt_with_sampling():
    sched = Scheduler(limits())
    request = submit(sched, 1, 5)
    (seq,) = request.choices
    assert seq.seq_id == 1 and not seq.live and list(sched.waiting) == [seq]
    plan = sched.schedule()
    assert plan == StepPlan(ops=(AddSequence(1, GREEDY),), entries=(prefill(1, prompt(1, 5), True),), seqs=(seq,))
    assert seq.live and not seq.draft_live and seq.num_prefilled == 5 and seq.prefill_left == 0
    assert sched.running == [seq] and not sched.waiting and request.cached_prompt_tokens == 0
    assert sched.schedule().empty  # nothing sampled yet: nothing to do
    run(sched, plan)
    assert sched.kv.length(1) == 5 and sched.kv.cache.sequence_tokens(1) == list(prompt(1, 5))
    assert seq.output_ids == [FIRST] and seq.pending_token == FIRST
    plan = sched.schedule()
    assert plan == StepPlan(ops=(), entries=(decode(1, FIRST),), seqs=(seq,))
    assert seq.pending_token is None  # consumed: it goes into the KV this step
    run(sched, plan)
    assert sched.kv.length(1) == 6 and sched.kv.cache.sequence_tokens(1) == [*prompt(1, 5), FIRST]


def test_long_prompt_is_chunked_and_only_the_last_chunk_samples():
    sched = Scheduler(limits(prefill_chunk_size=4))
    (seq,) = submit(sched, 1, 10).choices
    first = step(sched)
    assert first.ops == (AddSequence(1, GREEDY),)
    assert first.entries == (prefill(1, prompt(1, 10)[0:4], False),)
    assert seq.output_ids == [] and seq.pending_token is None
    second = step(sched)
    assert second.ops == ()  # added once only
    assert second.entries == (prefill(1, prompt(1, 10)[4:8], False),)
    third = step(sched)
    assert third.entries == (prefill(1, prompt(1, 10)[8:10], True),)
    assert third.seqs == (seq,) and seq.prefill_left == 0 and sched.kv.length(1) == 10
    assert sched.schedule().entries == (decode(1, FIRST),)


def test_prompt_of_exactly_the_chunk_size_is_one_sampled_chunk():
    sched = Scheduler(limits(prefill_chunk_size=4))
    submit(sched, 1, 4)
    assert sched.schedule().entries == (prefill(1, prompt(1, 4), True),)
    assert sched.schedule().empty


def test_prefill_budget_is_shared_across_requests_in_one_step():
    sched = Scheduler(limits(prefill_chunk_size=8))
    a, b, c = (submit(sched, tag, length).choices[0] for tag, length in ((1, 5), (2, 6), (3, 2)))
    plan = step(sched)
    # a takes 5, b gets the 3 left; c waits: no budget is left to start it.
    assert plan.ops == (AddSequence(1, GREEDY), AddSequence(2, GREEDY))
    assert plan.entries == (prefill(1, prompt(1, 5), True), prefill(2, prompt(2, 3), False))
    assert plan.seqs == (a, b)
    assert list(sched.waiting) == [c] and not c.live
    # a's decode takes no budget; b's prefill in progress comes before the new admission.
    plan = step(sched)
    assert plan.ops == (AddSequence(3, GREEDY),)
    assert plan.entries == (decode(1, FIRST), prefill(2, prompt(2, 6)[3:], True), prefill(3, prompt(3, 2), True))
    assert plan.seqs == (a, b, c)


def test_decodes_come_first_and_do_not_use_the_prefill_budget():
    sched = Scheduler(limits(prefill_chunk_size=4))
    a = submit(sched, 1, 2).choices[0]
    assert step(sched).entries == (prefill(1, prompt(1, 2), True),)
    b = submit(sched, 2, 6).choices[0]
    plan = sched.schedule()
    assert plan.ops == (AddSequence(2, GREEDY),)
    assert plan.entries == (decode(1, FIRST), prefill(2, prompt(2, 4), False))
    assert plan.seqs == (a, b)


def test_on_result_pops_rejected_drafts_from_the_kv_mirror():
    sched = Scheduler(limits())
    (seq,) = submit(sched, 1, 5).choices
    step(sched)
    plan = sched.schedule()
    verify = replace(plan.entries[0], token_ids=(FIRST, 60, 61, 62), num_draft_tokens=3)  # as the speculator does
    plan = replace(plan, entries=(verify,))
    sched.commit(plan)
    assert sched.kv.length(1) == 9
    sched.on_result(seq, verify, EntryResult(1, (SampledToken(60, 0.0), SampledToken(70, 0.0)), num_accepted=1))
    assert sched.kv.length(1) == 7  # two drafts rejected
    assert sched.kv.cache.sequence_tokens(1) == [*prompt(1, 5), FIRST, 60]


# -- the sequence budget ----------------------------------------------------------------------


def test_sequence_budget_counts_spec_draft_length_plus_one_per_running_sequence():
    sched = Scheduler(limits(max_num_sequence=10, spec_draft_length=4))
    assert sched.limits.max_running == 2
    r1, r2, r3, r4 = (submit(sched, tag, 3) for tag in (1, 2, 3, 4))
    plan = step(sched)
    assert plan.ops == (AddSequence(1, GREEDY), AddSequence(2, GREEDY))
    assert [e.seq_id for e in plan.entries] == [1, 2]
    assert list(sched.waiting) == [r3.choices[0], r4.choices[0]]
    plan = step(sched)  # still full
    assert plan == StepPlan((), (decode(1, FIRST), decode(2, FIRST)), (r1.choices[0], r2.choices[0]))
    finish(sched, r1.choices[0])  # recycled: held, but no longer running
    plan = step(sched)
    assert plan.ops == (AddSequence(3, GREEDY),)
    assert plan.entries == (decode(2, FIRST + 1), prefill(3, prompt(3, 3), True))
    sched.release(r2)
    plan = step(sched)
    assert plan.ops == (RemoveSequence(2), AddSequence(4, GREEDY))
    assert plan.entries == (decode(3, FIRST), prefill(4, prompt(4, 3), True))
    assert sched.running == [r3.choices[0], r4.choices[0]] and not sched.waiting


# -- the prefix cache -------------------------------------------------------------------------


def test_same_prompt_after_a_finished_request_forks_the_recycled_sequence():
    sched = Scheduler(limits())
    first = submit(sched, 1, 8).choices[0]
    step(sched)
    finish(sched, first)
    assert sched.kv.recycled_ids() == [1] and sched.running == []
    request = submit(sched, 2, 8, same_as=1)
    plan = sched.schedule()
    # 7 of 8 tokens cached (the last one is always prefilled); 7 > 0.9 * 8 fails: fork, no reuse.
    assert plan == StepPlan(ops=(ForkSequence(2, 1, 7, GREEDY),), entries=(prefill(2, (107,), True),),
                            seqs=(request.choices[0],))
    assert request.cached_prompt_tokens == 7 and sched.kv.held == 2


def test_same_prompt_forks_a_live_sequence():
    sched = Scheduler(limits())
    submit(sched, 1, 8)
    step(sched)
    submit(sched, 2, 8, same_as=1)
    plan = sched.schedule()
    assert plan.ops == (ForkSequence(2, 1, 7, GREEDY),)
    assert plan.entries == (decode(1, FIRST), prefill(2, (107,), True))


def test_a_recycled_sequence_the_prompt_almost_covers_is_reused():
    sched = Scheduler(limits(prefill_chunk_size=32))
    first = submit(sched, 1, 20).choices[0]
    step(sched)
    finish(sched, first)
    free = sched.kv.free_pages
    request = submit(sched, 2, 20, same_as=1)
    plan = run(sched, sched.schedule())
    # 19 > 0.9 * 20: the new sequence takes the pages over, the recycled one goes.
    assert plan.ops == (ForkSequence(2, 1, 19, GREEDY), RemoveSequence(1))
    assert plan.entries == (prefill(2, (119,), True),)
    assert request.cached_prompt_tokens == 19
    assert sched.kv.held == 1 and sched.kv.free_pages == free and sched.kv.length(2) == 20


def test_a_lagging_draft_forks_one_token_earlier_in_both_services():
    sched = Scheduler(limits(spec_draft_length=1), speculating)
    first = submit(sched, 1, 8).choices[0]
    plan = step(sched)
    assert plan.draft_ops == plan.ops == (AddSequence(1, GREEDY),) and first.draft_live
    finish(sched, first)
    request = submit(sched, 2, 8, same_as=1)
    plan = sched.schedule()
    assert plan.ops == plan.draft_ops == (ForkSequence(2, 1, 6, GREEDY),)
    assert plan.entries == (prefill(2, (106, 107), True),)
    assert request.cached_prompt_tokens == 6 and request.choices[0].draft_live


def test_a_lagging_draft_reuse_forks_one_token_earlier_and_removes_in_both_services():
    sched = Scheduler(limits(spec_draft_length=1, prefill_chunk_size=32), speculating)
    first = submit(sched, 1, 20).choices[0]
    step(sched)
    finish(sched, first)
    request = submit(sched, 2, 20, same_as=1)
    plan = sched.schedule()
    assert plan.ops == plan.draft_ops == (ForkSequence(2, 1, 18, GREEDY), RemoveSequence(1))
    assert plan.entries == (prefill(2, (118, 119), True),)
    assert request.cached_prompt_tokens == 18


def test_a_speculating_request_matches_only_sequences_the_draft_holds():
    sched = Scheduler(limits(spec_draft_length=1), speculating)
    plain = submit(sched, 1, 8, speculate=False).choices[0]
    plan = step(sched)
    assert plan.ops == (AddSequence(1, GREEDY),) and plan.draft_ops == ()
    finish(sched, plain)
    request = submit(sched, 2, 8, same_as=1)
    plan = sched.schedule()
    assert plan.ops == plan.draft_ops == (AddSequence(2, GREEDY),)
    assert plan.entries == (prefill(2, prompt(1, 8), True),) and request.cached_prompt_tokens == 0


def test_a_plain_request_forks_a_speculated_sequence_without_the_lag():
    sched = Scheduler(limits(spec_draft_length=1), speculating)
    first = submit(sched, 1, 8).choices[0]
    step(sched)
    finish(sched, first)
    submit(sched, 2, 8, same_as=1, speculate=False)
    plan = sched.schedule()
    assert plan.ops == (ForkSequence(2, 1, 7, GREEDY),) and plan.draft_ops == ()
    assert plan.entries == (prefill(2, (107,), True),)


def test_no_recycling_turns_the_prefix_cache_off_for_finished_sequences():
    sched = Scheduler(limits(prefix_cache_max_num_recycling_seqs=0))
    first = submit(sched, 1, 8).choices[0]
    step(sched)
    finish(sched, first)
    request = submit(sched, 2, 8, same_as=1)
    plan = sched.schedule()
    assert plan.ops == (RemoveSequence(1), AddSequence(2, GREEDY))
    assert plan.entries == (prefill(2, prompt(1, 8), True),)
    assert request.cached_prompt_tokens == 0 and sched.kv.held == 1


# -- request trees (n > 1) --------------------------------------------------------------------


def test_a_tree_prefills_the_parent_then_forks_every_child_and_removes_the_parent():
    sched = Scheduler(limits())
    request = submit(sched, 1, 5, n=3, sampler=SEEDED)
    parent, children = request.parent, request.choices
    assert parent.is_parent and parent.seq_id == 1 and list(sched.waiting) == [parent]
    plan = step(sched)
    assert plan == StepPlan(ops=(AddSequence(1, SEEDED),), entries=(prefill(1, prompt(1, 4), False),), seqs=(parent,))
    assert parent.output_ids == [] and sched.running == [] and sched.forking == [parent]
    plan = step(sched)
    s0, s1, s2 = (child_sampler(SEEDED, i, 3) for i in range(3))
    assert plan.ops == (ForkSequence(2, 1, 4, s0), ForkSequence(3, 1, 4, s1), ForkSequence(4, 1, 4, s2),
                        RemoveSequence(1))
    assert plan.entries == (prefill(2, (104,), True), prefill(3, (104,), True), prefill(4, (104,), True))
    assert plan.seqs == tuple(children) and plan.draft_ops == ()
    assert [c.seq_id for c in children] == [2, 3, 4] and all(c.live and not c.draft_live for c in children)
    assert not parent.live and sched.forking == [] and request.unactivated == []
    assert sched.kv.held == 3 and sched.kv.free_pages == 64 - 1 - 3  # the shared prompt page + one each
    assert step(sched).entries == (decode(2, FIRST), decode(3, FIRST), decode(4, FIRST))


def test_a_speculating_tree_forks_the_draft_one_position_earlier():
    sched = Scheduler(limits(spec_draft_length=1), speculating)
    request = submit(sched, 1, 5, n=3, sampler=SEEDED)
    plan = step(sched)
    assert plan.ops == plan.draft_ops == (AddSequence(1, SEEDED),) and request.parent.draft_live
    plan = sched.schedule()
    s0, s1, s2 = (child_sampler(SEEDED, i, 3) for i in range(3))
    assert plan.ops == (ForkSequence(2, 1, 4, s0, draft_position=3), ForkSequence(3, 1, 4, s1, draft_position=3),
                        ForkSequence(4, 1, 4, s2, draft_position=3), RemoveSequence(1))
    assert plan.draft_ops == (ForkSequence(2, 1, 3, s0), ForkSequence(3, 1, 3, s1), ForkSequence(4, 1, 3, s2),
                              RemoveSequence(1))
    assert all(c.draft_live for c in request.choices)


def test_a_small_prefill_budget_activates_children_over_several_steps():
    sched = Scheduler(limits(prefill_chunk_size=2))
    request = submit(sched, 1, 3, n=3, sampler=SEEDED)
    s0, s1, s2 = (child_sampler(SEEDED, i, 3) for i in range(3))
    assert step(sched).entries == (prefill(1, (100, 101), False),)
    plan = step(sched)
    assert plan.ops == (ForkSequence(2, 1, 2, s0), ForkSequence(3, 1, 2, s1))
    assert plan.entries == (prefill(2, (102,), True), prefill(3, (102,), True))
    assert request.unactivated == [request.choices[2]] and sched.forking == [request.parent]
    plan = step(sched)
    assert plan.ops == (ForkSequence(4, 1, 2, s2), RemoveSequence(1))
    assert plan.entries == (decode(2, FIRST), decode(3, FIRST), prefill(4, (102,), True))


def test_a_child_without_a_sequence_slot_is_activated_when_one_frees():
    sched = Scheduler(limits(max_num_sequence=2))
    request = submit(sched, 1, 3, n=3, sampler=SEEDED)
    step(sched)
    plan = step(sched)
    assert plan.ops == (ForkSequence(2, 1, 2, request.choices[0].sampler),
                        ForkSequence(3, 1, 2, request.choices[1].sampler))
    plan = step(sched)  # both slots taken: the parent stays, the third child waits
    assert plan.ops == () and plan.entries == (decode(2, FIRST), decode(3, FIRST))
    assert request.parent.live and request.unactivated == [request.choices[2]]
    finish(sched, request.choices[0])
    plan = step(sched)
    assert plan.ops == (ForkSequence(4, 1, 2, request.choices[2].sampler), RemoveSequence(1))
    assert plan.entries == (decode(3, FIRST + 1), prefill(4, (102,), True))
    assert sched.kv.held == 3  # two children running, the finished one recycled


def test_a_tree_whose_shared_prefix_is_cached_forks_its_children_next_step():
    sched = Scheduler(limits())
    first = submit(sched, 1, 5).choices[0]
    step(sched)
    finish(sched, first)
    request = submit(sched, 2, 5, same_as=1, n=2, sampler=SEEDED)
    plan = step(sched)
    assert plan == StepPlan(ops=(ForkSequence(2, 1, 4, SEEDED),), entries=(), seqs=())
    assert not plan.empty and request.cached_prompt_tokens == 4 and sched.forking == [request.parent]
    plan = sched.schedule()
    assert plan.ops == (ForkSequence(3, 2, 4, request.choices[0].sampler),
                        ForkSequence(4, 2, 4, request.choices[1].sampler), RemoveSequence(2))
    assert plan.entries == (prefill(3, (104,), True), prefill(4, (104,), True))


def test_children_have_distinct_seeds_derived_from_the_request_seed():
    sched = Scheduler(limits())
    tree = new_request(GenerationSpec("t", prompt(1, 3), SEEDED, 4, n=3), sched.new_seq_id)
    seeds = [c.sampler.seed for c in tree.choices]
    assert seeds == [child_sampler(SEEDED, i, 3).seed for i in range(3)]
    assert len(set(seeds)) == 3 and 7 not in seeds
    assert [replace(c.sampler, seed=7) for c in tree.choices] == [SEEDED] * 3  # only the seed differs
    assert tree.parent.sampler == SEEDED
    single = new_request(GenerationSpec("s", prompt(1, 3), SEEDED, 4), sched.new_seq_id)
    assert single.choices[0].sampler == SEEDED and single.parent is None
    unseeded = new_request(GenerationSpec("u", prompt(1, 3), GREEDY, 4, n=2), sched.new_seq_id)
    assert [c.sampler for c in unseeded.choices] == [GREEDY, GREEDY]


def test_a_one_token_prompt_with_n_2_is_two_independent_sequences():
    sched = Scheduler(limits())
    request = submit(sched, 1, 1, n=2, sampler=SEEDED)
    assert request.parent is None and [c.seq_id for c in request.choices] == [1, 2]
    plan = sched.schedule()
    s0, s1 = (child_sampler(SEEDED, i, 2) for i in range(2))
    assert plan.ops == (AddSequence(1, s0), AddSequence(2, s1))
    assert plan.entries == (prefill(1, (100,), True), prefill(2, (100,), True))


# -- held sequences and eviction --------------------------------------------------------------


def test_recycled_sequences_are_evicted_to_admit_new_ones_within_max_held_sequences():
    sched = Scheduler(limits(max_held_sequences=2))
    r1, r2 = submit(sched, 1, 3), submit(sched, 2, 3)
    step(sched)
    finish(sched, r1.choices[0])
    finish(sched, r2.choices[0])
    submit(sched, 3, 3), submit(sched, 4, 3)
    r5 = submit(sched, 5, 3)
    plan = sched.schedule()
    # Least recently recycled first; 5 waits: both held sequences are running.
    assert plan.ops == (RemoveSequence(1), AddSequence(3, GREEDY), RemoveSequence(2), AddSequence(4, GREEDY))
    assert [e.seq_id for e in plan.entries] == [3, 4]
    assert list(sched.waiting) == r5.choices and sched.kv.evicted_total == 2 and sched.kv.held == 2


def test_the_recycling_limit_evicts_the_oldest_recycled_sequence():
    sched = Scheduler(limits(prefix_cache_max_num_recycling_seqs=1))
    r1, r2 = submit(sched, 1, 3), submit(sched, 2, 3)
    step(sched)
    finish(sched, r1.choices[0])
    finish(sched, r2.choices[0])
    assert sched.schedule() == StepPlan(ops=(RemoveSequence(1),), entries=(), seqs=())
    assert sched.kv.recycled_ids() == [2]
