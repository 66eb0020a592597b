"""Overload control's pure parts: the drain rate behind the retry pushback, the queue's refusal
and the cap on running requests."""

import pytest

from router.overload import MAX_RETRY_MS, MIN_RETRY_MS, UNKNOWN_RATE_RETRY_MS, DrainRate, QueueFull
from router.scheduler import Scheduler
from tests.unit.scheduler_helpers import limits, run, submit


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_no_finishes_yet_gives_the_fixed_guess():
    assert DrainRate(clock=Clock()).retry_after_ms(5) == UNKNOWN_RATE_RETRY_MS


def test_the_hint_is_the_queue_ahead_over_the_recent_rate():
    clock = Clock()
    drain = DrainRate(window_s=30, clock=clock)
    for _ in range(10):  # ten requests finished over ten seconds: one a second
        drain.record()
        clock.now += 1.0
    assert drain.per_second() == pytest.approx(1.0)
    assert drain.retry_after_ms(3) == 3000
    assert drain.retry_after_ms(0) == MIN_RETRY_MS
    assert drain.retry_after_ms(10_000) == MAX_RETRY_MS


def test_finishes_older_than_the_window_are_forgotten():
    clock = Clock()
    drain = DrainRate(window_s=5, clock=clock)
    drain.record()
    clock.now += 6
    assert drain.per_second() == 0.0 and drain.retry_after_ms(1) == UNKNOWN_RATE_RETRY_MS


def test_a_burst_is_not_a_rate_of_thousands():
    clock = Clock()
    drain = DrainRate(clock=clock)
    for _ in range(3):
        drain.record()
    assert drain.per_second() == 3.0  # over at least a second


def test_a_full_queue_says_how_many_are_ahead():
    sched = Scheduler(limits(max_waiting=2))
    submit(sched, 1, 2)
    submit(sched, 2, 2)
    with pytest.raises(QueueFull) as info:
        submit(sched, 3, 2)
    assert info.value.waiting == 2 and "max_waiting" in str(info.value)


def test_max_running_requests_keeps_later_requests_waiting():
    sched = Scheduler(limits(max_running_requests=2))
    first, second, third = (submit(sched, tag, 2, max_tokens=8) for tag in (1, 2, 3))
    run(sched, sched.schedule())
    assert {s.request for s in sched.running} == {first, second}
    assert [s.request for s in sched.waiting] == [third]
    sched.release(first)
    run(sched, sched.schedule())
    assert {s.request for s in sched.running} == {second, third}


def test_a_tree_counts_as_one_running_request():
    sched = Scheduler(limits(max_running_requests=1))
    tree = submit(sched, 1, 4, n=3, max_tokens=8)
    other = submit(sched, 2, 2)
    for _ in range(3):
        run(sched, sched.schedule())
    assert {s.request for s in (*sched.running, *sched.forking)} == {tree}
    assert len([s for s in sched.running if s.request is tree]) == 3
    assert [s.request for s in sched.waiting] == [other]
