"""The draft service comes back after a failure: sequences that lost it re-prefill to speculate
again, where that is worth a prefill and changes no output."""

import random

from router.request import FinishReason
from router.draft_mirror import RESPECULATE_MIN_TOKENS_LEFT
from router.scheduler import Scheduler
from tandem.ops import AddSequence, ForkSequence, RemoveSequence
from tests.unit.scheduler_helpers import (FIRST, GREEDY, decode, finish, limits, prefill, prompt, run, speculating,
                                          step, submit)


def lose_the_draft(sched: Scheduler, steps: int = 2) -> None:
    sched.draft_lost()
    for _ in range(steps):
        assert step(sched).draft_ops == ()


def test_a_sequence_that_lost_the_draft_re_prefills_to_speculate_once_it_is_back():
    sched = Scheduler(limits(spec_draft_length=1), speculating)
    seq = submit(sched, 1, 8, max_tokens=64).choices[0]
    step(sched)
    assert seq.draft_live
    lose_the_draft(sched)
    assert not seq.draft_live and seq.output_ids == [FIRST, FIRST + 1, FIRST + 2]
    sched.draft_back()
    plan = run(sched, sched.schedule())
    outputs = (FIRST, FIRST + 1, FIRST + 2)
    resumed = AddSequence(2, GREEDY, num_prompt_tokens=8)  # its output so far counts as output
    assert plan.ops == (RemoveSequence(1), resumed) and plan.draft_ops == (resumed,)
    assert plan.entries == (prefill(2, prompt(1, 8) + outputs, True),)
    assert seq.draft_live and seq.output_ids == [*outputs, FIRST + 3]  # nothing lost or repeated
    assert sched.respeculated_total == 1 and sched.preempted_total == 0
    assert step(sched).entries == (decode(2, FIRST + 3),)
    sched.draft_back()  # it speculates already: nothing to do
    assert step(sched).ops == () and sched.respeculated_total == 1


def test_sequences_a_re_prefill_would_not_pay_for_keep_decoding_plainly():
    sched = Scheduler(limits(spec_draft_length=1, max_total_sequence_length=1024, kv_page_size=16,
                             prefill_chunk_size=256), speculating)
    short = submit(sched, 2, 4, max_tokens=RESPECULATE_MIN_TOKENS_LEFT + 1).choices[0]
    long_context = submit(sched, 3, 200, max_tokens=48).choices[0]  # 48 left < 200 // 4
    plain = submit(sched, 4, 4, max_tokens=64, speculate=False).choices[0]
    step(sched)
    lose_the_draft(sched)  # short has 32 - 2 left now
    sched.draft_back()
    plan = sched.schedule()
    assert plan.ops == () and {s.seq_id for s in plan.seqs} == {s.seq_id for s in (short, long_context, plain)}
    assert not any(s.draft_live for s in plan.seqs) and sched.respeculated_total == 0


def test_a_parent_with_children_left_to_fork_re_prefills_so_they_speculate():
    sched = Scheduler(limits(spec_draft_length=1, max_num_sequence=4), speculating)  # 2 running at most
    request = submit(sched, 1, 5, n=3, max_tokens=64)
    parent, (c0, c1, c2) = request.parent, request.choices
    step(sched)
    lose_the_draft(sched, steps=1)  # the children fork from a parent the draft no longer holds
    assert not (c0.draft_live or c1.draft_live) and request.unactivated == [c2] and sched.forking == [parent]
    sched.draft_back()
    plan = run(sched, sched.schedule())
    assert [s for s in plan.seqs] == [c0, c1] and c0.draft_live and c1.draft_live
    assert list(sched.waiting) == [parent] and not parent.live and sched.respeculated_total == 3
    for seq in (c0, c1):
        seq.finish_reason = FinishReason.LENGTH
        sched.finish(seq)
    for _ in range(3):
        step(sched)
    assert c2.live and c2.draft_live  # forked from the re-prefilled parent, in both services


def test_a_sequence_re_prefills_for_a_returning_draft_once_at_most():
    """A draft that fails again right after it is back (its peer stream down, say) must not
    restart a long prefill at every recovery."""
    sched = Scheduler(limits(spec_draft_length=1, prefill_chunk_size=4), speculating)
    seq = submit(sched, 1, 16, max_tokens=64).choices[0]
    step(sched)
    lose_the_draft(sched)
    assert seq.num_prefilled == 12 and not seq.draft_live
    sched.draft_back()
    step(sched)
    assert seq.num_prefilled == 4 and seq.draft_live and sched.respeculated_total == 1
    lose_the_draft(sched)
    sched.draft_back()
    step(sched)
    assert seq.num_prefilled == 16 and not seq.draft_live and sched.respeculated_total == 1
    assert seq.output_ids == [FIRST]


def test_re_prefills_wait_while_the_batch_is_too_large_to_draft():
    sched = Scheduler(limits(spec_draft_length=1, spec_disable_batch_size=2), speculating)
    a, b = (submit(sched, tag, 4, max_tokens=64).choices[0] for tag in (1, 2))
    step(sched)
    lose_the_draft(sched)
    sched.draft_back()
    plan = step(sched)
    assert plan.ops == () and not (a.draft_live or b.draft_live) and sched.respeculated_total == 0
    a.finish_reason = FinishReason.STOP
    sched.finish(a)
    step(sched)  # b decodes alone now: drafting would not pause, so it re-prefills
    assert b.draft_live and sched.respeculated_total == 1


def draft_model(capacity: int):
    """The draft service's own count: it refuses a sequence past its max_num_sequence."""
    held: set[int] = set()

    def apply(plan) -> None:
        for op in plan.draft_ops:
            if isinstance(op, RemoveSequence):
                assert op.seq_id in held, "the draft was told to remove a sequence it does not hold"
                held.discard(op.seq_id)
                continue
            if isinstance(op, ForkSequence):
                assert op.parent_id in held, "the draft was told to fork a sequence it does not hold"
            assert len(held) < capacity, "the draft was sent more sequences than it takes"
            held.add(op.seq_id)
    return apply


def test_sequences_past_the_drafts_own_capacity_run_plainly():
    """A draft that came back with a smaller --max-num-sequence than the limits were resolved
    with (or found after a router that started without it) would fail whole draft calls."""
    capacity = [2]
    sched = Scheduler(limits(spec_draft_length=1, max_num_sequence=16), speculating, draft_capacity=lambda: capacity[0])
    draft = draft_model(3)
    a, b, c = (submit(sched, tag, 4, max_tokens=8).choices[0] for tag in (1, 2, 3))
    draft(step(sched))
    assert [s.draft_live for s in (a, b, c)] == [True, True, False]
    capacity[0] = 3
    request = submit(sched, 4, 5, n=2, max_tokens=8)
    draft(step(sched))
    assert not request.parent.draft_live  # a parent needs two places: itself and a child
    for _ in range(8):
        draft(step(sched))


def test_recycled_sequences_leave_the_draft_to_make_room():
    """They would otherwise fill its capacity for good (evictions follow the target's limits)."""
    sched = Scheduler(limits(spec_draft_length=1, max_num_sequence=16), speculating, draft_capacity=lambda: 2)
    draft = draft_model(2)
    for tag in (1, 2):
        seq = submit(sched, tag, 4, max_tokens=8).choices[0]
        draft(step(sched))
        seq.finish_reason = FinishReason.STOP
        sched.finish(seq)
    assert sched.kv.recycled_ids() == [1, 2] and sched.draft.held == {1, 2}
    seq = submit(sched, 3, 4, max_tokens=8).choices[0]
    plan = step(sched)
    draft(plan)
    assert seq.draft_live and plan.draft_ops[0] == RemoveSequence(1)  # the least recently recycled
    assert sched.kv.recycled_ids() == [1, 2]  # the target keeps both for prefix matches


def test_re_prefills_take_no_more_places_than_the_draft_has():
    sched = Scheduler(limits(spec_draft_length=1, max_num_sequence=16), speculating, draft_capacity=lambda: 1)
    a, b = (submit(sched, tag, 4, max_tokens=64).choices[0] for tag in (1, 2))
    step(sched)
    assert a.draft_live and not b.draft_live
    lose_the_draft(sched)
    sched.draft_back()
    step(sched)
    assert a.draft_live and not b.draft_live and b.draft.reprefills == 0 and sched.respeculated_total == 1


def test_a_dropped_recycled_sequence_is_matched_only_by_plain_requests_and_nothing_is_dropped_in_vain():
    sched = Scheduler(limits(spec_draft_length=1, max_num_sequence=16), speculating, draft_capacity=lambda: 2)
    draft = draft_model(2)
    first = submit(sched, 1, 8, max_tokens=8).choices[0]
    draft(step(sched))
    first.finish_reason = FinishReason.STOP
    sched.finish(first)
    live = submit(sched, 2, 4, max_tokens=64).choices[0]
    draft(step(sched))
    assert sched.draft.held == {1, live.seq_id}
    request = submit(sched, 3, 5, n=2, max_tokens=8)  # a parent needs 2 places: 1 can be freed
    plan = step(sched)
    draft(plan)
    assert not request.parent.draft_live and RemoveSequence(1) not in plan.draft_ops  # kept: in vain
    same = submit(sched, 4, 8, max_tokens=8, same_as=1).choices[0]  # matches recycled 1
    plan = step(sched)
    draft(plan)
    assert same.draft_live and plan.draft_ops[0] == RemoveSequence(1)
    assert not any(isinstance(op, ForkSequence) and op.parent_id == 1 for op in plan.draft_ops)
    for _ in range(12):  # evictions and finishes never send the draft a removal it cannot take
        draft(step(sched))


def test_a_sequence_the_full_draft_turned_away_speculates_once_a_place_frees():
    sched = Scheduler(limits(spec_draft_length=1, max_num_sequence=16), speculating, draft_capacity=lambda: 1)
    draft = draft_model(1)
    a, b = (submit(sched, tag, 4, max_tokens=64).choices[0] for tag in (1, 2))
    short = submit(sched, 3, 4, max_tokens=RESPECULATE_MIN_TOKENS_LEFT).choices[0]
    draft(step(sched))
    assert a.draft_live and not (b.draft_live or short.draft_live) and b.draft_denied
    for _ in range(3):
        draft(step(sched))
    assert not b.draft_live  # no place has freed
    a.finish_reason = FinishReason.STOP
    sched.finish(a)
    plan = run(sched, sched.schedule())
    draft(plan)
    outputs = b.output_ids[:-1]
    assert plan.draft_ops[0] == RemoveSequence(1)  # a, recycled: its place goes to b
    assert plan.entries == (decode(short.seq_id, short.output_ids[-2]), prefill(b.seq_id, prompt(2, 4) + tuple(outputs), True))
    assert b.draft_live and sched.respeculated_total == 1 and not short.draft_live  # short: too few tokens left
    for _ in range(8):
        draft(step(sched))


def test_children_of_a_parent_the_full_draft_turned_away_speculate_once_places_free():
    sched = Scheduler(limits(spec_draft_length=1, max_num_sequence=16), speculating, draft_capacity=lambda: 2)
    draft = draft_model(2)
    a = submit(sched, 1, 4, max_tokens=64).choices[0]
    draft(step(sched))
    request = submit(sched, 2, 5, n=2, max_tokens=64)  # its parent needs 2 places: 1 is free
    for _ in range(3):
        draft(step(sched))
    c0, c1 = request.choices
    assert a.draft_live and not (request.parent.draft_live or c0.draft_live or c1.draft_live)
    assert c0.live and c1.live and c0.draft_denied and c1.draft_denied
    a.finish_reason = FinishReason.STOP
    sched.finish(a)
    plan = run(sched, sched.schedule())
    draft(plan)
    assert c0.draft_live and c1.draft_live and sched.respeculated_total == 2
    for _ in range(8):
        draft(step(sched))


def test_a_re_prefill_that_found_the_draft_full_is_not_its_one_and_the_next_freed_place_is_its():
    """Requeued to speculate, `late` waited for a sequence slot while sequences requeued after it
    went first and took the draft's places."""
    sched = Scheduler(limits(spec_draft_length=1, max_num_sequence=8), speculating, draft_capacity=lambda: 3)
    draft = draft_model(3)
    one = submit(sched, 1, 5, n=3, max_tokens=64)
    draft(step(sched))
    two = submit(sched, 2, 4, n=2, max_tokens=64)  # its parent needs 2 places: 1 is free
    for _ in range(4):
        draft(step(sched))
    late = one.choices[2]  # turned away at its fork (the parent held a place), requeued once it left
    assert late.draft.reprefills == 1 and not late.live and not any(c.draft_live for c in two.choices)
    finish(sched, one.choices[1])  # a place frees: two's children, requeued ahead of late, take both
    draft(step(sched))
    assert all(c.draft_live for c in two.choices) and late.live and late.draft_denied and not late.draft_live
    finish(sched, one.choices[0])
    draft(step(sched))
    assert late.draft_live and sched.respeculated_total == 4
    for _ in range(8):
        draft(step(sched))


def test_no_sequence_re_prefills_more_than_twice_whatever_takes_the_draft_first():
    """Random trees, plain requests and finishes against a small draft: a sequence that lost its
    re-prefill's place gets one more try, never a third, and nothing is sent the draft it cannot take."""
    retried = 0
    for seed in range(60):
        rng = random.Random(seed)
        capacity = rng.choice([2, 3])
        sched = Scheduler(limits(spec_draft_length=1, max_num_sequence=rng.choice([6, 8])), speculating,
                          draft_capacity=lambda: capacity)
        draft, requests = draft_model(capacity), []
        for tag in range(1, 40):
            if rng.random() < 0.3 and len(requests) < 8:
                requests.append(submit(sched, tag, rng.choice([4, 5, 9]), n=rng.choice([1, 1, 2, 3]), max_tokens=64))
            elif live := [s for r in requests for s in r.choices if s.live and s.output_ids]:
                if rng.random() < 0.3:
                    finish(sched, rng.choice(live))
            draft(step(sched))
        reprefills = [s.draft.reprefills for r in requests for s in (*r.choices, r.parent) if s]
        assert max(reprefills, default=0) <= 2, seed
        retried += reprefills.count(2)
    assert retried  # the second try was taken
