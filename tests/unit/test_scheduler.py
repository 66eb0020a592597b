"""Scheduler: admission, chunked prefill, decodes, the sequence budget, the prefix cache, request
trees (n > 1), eviction, preemption and release, as literal plans; then EngineLimits.

`run` plays the engine's part of a step: commit the plan, report each entry's result, then what
the output processor does with a sampled token (count it as output, leave it pending for the
next decode). The fake model samples FIRST, FIRST + 1, ... for every sequence, so each literal
decode names how far its sequence got.
"""

from dataclasses import replace
from pathlib import Path

import pytest

from router.config import RouterConfig
from router.limits import EngineLimits, resolve_limits
from router.request import FinishReason, GenerationSpec, Request, child_sampler, new_request
from router.scheduler import Scheduler, StepPlan
from tandem.errors import InvalidArgument, ResourceExhausted
from tandem.ops import (AddSequence, EngineInfo, EntryKind, EntryResult, ForkSequence, RemoveSequence,
                        SampledToken, StepEntry)
from tandem.sampling.params import SamplingParams

GREEDY = SamplingParams(temperature=0.0)
SEEDED = SamplingParams(seed=7)
FIRST = 50


def limits(**overrides) -> EngineLimits:
    values = dict(max_num_sequence=8, max_held_sequences=16, max_total_sequence_length=256,
                  prefill_chunk_size=16, spec_draft_length=0, prefix_cache_max_num_recycling_seqs=-1,
                  kv_page_size=4, kv_pages_total=64, max_waiting=16)
    values.update(overrides)
    return EngineLimits(**values)


def speculating(seq) -> bool:
    return seq.spec.speculate


def prompt(tag: int, length: int) -> tuple[int, ...]:
    """Prompt tokens tag * 100 + i, so every chunk names its request."""
    return tuple(tag * 100 + i for i in range(length))


def submit(sched: Scheduler, tag: int, length: int, *, max_tokens: int = 4, n: int = 1,
           sampler: SamplingParams = GREEDY, speculate: bool = True, same_as: int | None = None) -> Request:
    """Enqueues a request (prompt(tag, length), or prompt(same_as, length))."""
    ids = prompt(tag if same_as is None else same_as, length)
    spec = GenerationSpec(f"r{tag}", ids, sampler, max_tokens, speculate=speculate, n=n)
    request = new_request(spec, sched.new_seq_id)
    sched.enqueue(request)
    return request


def prefill(seq_id: int, tokens: tuple[int, ...], sample: bool) -> StepEntry:
    return StepEntry(seq_id, EntryKind.PREFILL, tokens, sample)


def decode(seq_id: int, token: int) -> StepEntry:
    return StepEntry(seq_id, EntryKind.DECODE, (token,), True)


def run(sched: Scheduler, plan: StepPlan) -> StepPlan:
    sched.commit(plan)
    for entry, seq in zip(plan.entries, plan.seqs):
        token = FIRST + len(seq.output_ids)
        sched.on_result(seq, entry, EntryResult(entry.seq_id, (SampledToken(token, 0.0),) if entry.sample else ()))
        if entry.sample and seq.live:
            seq.output_ids.append(token)
            seq.pending_token = token
    return plan


def step(sched: Scheduler) -> StepPlan:
    return run(sched, sched.schedule())


def finish(sched: Scheduler, seq) -> None:
    seq.finish_reason = FinishReason.LENGTH
    sched.finish(seq)


def assert_nothing_held(sched: Scheduler) -> None:
    assert sched.kv.held == 0
    assert sched.kv.free_pages == sched.limits.kv_pages_total


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
    assert sched.cached_tokens_total > 0
    sched.flush_prefix_cache()
    sched.schedule()
    assert_nothing_held(sched)
    assert not sched.draft.held


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
