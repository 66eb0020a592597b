"""Request trees under tight limits: parents must never hold slots or pages that keep their own
(or other) children from running (found by review: each of these hung or overflowed)."""

import pytest

from router.limits import EngineLimits
from router.scheduler import Scheduler
from tandem.errors import InvalidArgument
from tests.unit.scheduler_helpers import finish, limits, run, submit


def drain(sched, requests, steps=200):
    """Runs steps as the engine would, finishing choices at max_tokens; every plan must fit
    (the page mirror raises otherwise)."""
    for _ in range(steps):
        plan = sched.schedule()
        run(sched, plan)
        for s in list(sched.running):
            if not s.is_parent and len(s.output_ids) >= s.spec.max_tokens:
                finish(sched, s)
        if all(r.finished for r in requests):
            return
    raise AssertionError("requests never finished: " + str([len(r.unactivated) for r in requests]))


def test_trees_submitted_together_do_not_fill_the_held_limit_with_parents():
    sched = Scheduler(limits(max_num_sequence=4, max_held_sequences=4))
    requests = [submit(sched, t, 6, n=2) for t in range(1, 5)]
    drain(sched, requests)
    assert all(len(c.output_ids) == 4 for r in requests for c in r.choices)


def test_a_tree_whose_prompt_nearly_fills_the_cache_forks_its_children():
    sched = Scheduler(limits(kv_page_size=4, kv_pages_total=4, max_total_sequence_length=16))
    request = submit(sched, 1, 11, max_tokens=1, n=2)
    drain(sched, [request])
    assert all(c.output_ids for c in request.choices)


def test_an_idle_parent_is_preempted_before_a_lone_decode_overflows():
    # X decodes alone while another tree's prefilled parent waits for a slot for its children.
    sched = Scheduler(limits(kv_page_size=4, kv_pages_total=8, max_total_sequence_length=32, max_num_sequence=2))
    x = submit(sched, 1, 4, max_tokens=23)
    tree = submit(sched, 2, 9, max_tokens=10, n=3)
    drain(sched, [x, tree])
    assert sched.preempted_total > 0


def test_held_limit_below_two_is_refused():
    with pytest.raises(InvalidArgument, match="max_held_sequences"):
        EngineLimits(max_num_sequence=4, max_held_sequences=1, max_total_sequence_length=16,
                     prefill_chunk_size=8, spec_draft_length=0, prefix_cache_max_num_recycling_seqs=-1,
                     kv_page_size=4, kv_pages_total=4)
