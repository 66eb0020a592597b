"""The figures behind /metrics and the Stats RPCs: histogram quantiles, rates, hit rate, and
what the router and engines record, with literal cases."""

import itertools

import pytest

from router.figures import RouterFigures
from router.request import FinishReason, GenerationSpec, new_request
from tandem.figures import EngineFigures, Histogram, RecentRate, hit_rate
from tandem.ops import EngineStats, EntryKind, StepEntry
from tandem.sampling.params import SamplingParams


def test_histogram_buckets_and_quantiles():
    h = Histogram((1.0, 2.0, 4.0))
    for v in (0.5, 1.5, 1.5, 3.0, 10.0):
        h.observe(v)
    s = h.snapshot()
    assert s.counts == (1, 2, 1, 1) and s.count == 5 and s.sum == pytest.approx(16.5)
    assert s.cumulative() == [1, 3, 4, 5]
    assert s.quantile(0.2) == pytest.approx(1.0)  # rank 1: the top of the first bucket
    assert s.quantile(0.5) == pytest.approx(1.75)  # rank 2.5: 1.5 of the 2 in (1, 2]
    assert s.quantile(0.8) == pytest.approx(4.0)
    assert s.quantile(1.0) == pytest.approx(4.0)  # in +Inf: the largest finite bound
    assert s.quantile(0.0) == pytest.approx(0.0)
    summary = s.summary()
    assert (summary.count, summary.p50) == (5, pytest.approx(1.75))


def test_histogram_observes_many_and_empty_is_zero():
    h = Histogram((0.1, 1.0))
    assert h.snapshot().quantile(0.99) == 0.0 and h.snapshot().summary().count == 0
    h.observe(0.05, times=4)
    s = h.snapshot()
    assert s.counts == (4, 0, 0) and s.sum == pytest.approx(0.2)
    assert s.quantile(0.5) == pytest.approx(0.05)
    assert Histogram().snapshot().bounds[0] <= 0.001 and Histogram().snapshot().bounds[-1] >= 100  # GPU and CPU


def test_hit_rate():
    assert hit_rate(3, 4) == 0.75
    assert hit_rate(0, 0) == 0.0


def test_recent_rate_forgets_old_events():
    r = RecentRate(started=0.0, window_s=10.0)
    r.add(5, now=1.0)
    r.add(5, now=2.0)
    assert r.rate(now=2.0) == pytest.approx(5.0)  # 10 over the 2 s since start
    assert r.rate(now=20.0) == 0.0
    r.add(30, now=15.0)
    assert r.rate(now=15.0) == pytest.approx(3.0)  # 30 over the 10 s window


def test_recent_rate_sums_events_of_one_second_together():
    r = RecentRate(started=0.0, window_s=10.0)
    for i in range(1000):  # a batch of sequences, many steps a second
        r.add(1, now=5.0 + i / 2000)
    r.add(7, now=6.2)
    assert len(r._events) == 2
    assert r.rate(now=10.0) == pytest.approx(1007 / 10.0)
    assert r.rate(now=15.5) == pytest.approx(7 / 10.0)  # the second at 5 s has left the window


def test_engine_figures_count_tokens_by_kind():
    f = EngineFigures(started=0.0)
    prefill = StepEntry(1, EntryKind.PREFILL, (1, 2, 3, 4, 5), True)
    verify = StepEntry(2, EntryKind.DECODE, (7, 8, 9), True, num_draft_tokens=2)
    f.record_step(0.25, (prefill, verify), now=1.0)
    f.record_step(0.75, proposed=4, now=2.0)
    stats = f.fill(EngineStats(10, 4, 2, steps_total=2), now=2.0)
    assert (stats.prefill_tokens_total, stats.decode_tokens_total, stats.verified_draft_tokens_total) == (5, 3, 2)
    assert stats.proposed_draft_tokens_total == 4
    assert stats.step_seconds.count == 2 and stats.step_seconds.sum == pytest.approx(1.0)
    assert stats.uptime_s == 2.0 and stats.tokens_per_second == pytest.approx(6.0)


def _request(n: int = 1):
    spec = GenerationSpec("r", (1, 2, 3), SamplingParams(), max_tokens=8, n=n)
    return new_request(spec, itertools.count(1).__next__)


def test_router_figures_time_requests():
    f = RouterFigures(started=0.0)
    request = _request()
    seq = request.choices[0]
    f.on_submit(request, now=0.0)
    f.on_tokens(seq, 1, now=0.5)  # the first token: time to first token 0.5
    f.on_tokens(seq, 3, now=1.1)  # three tokens 0.6 s later: three gaps of 0.2
    f.on_tokens(seq, 0, now=1.2)  # nothing emitted: nothing recorded
    seq.finish_reason = FinishReason.LENGTH
    assert f.on_finished(request, now=2.0) == "length"
    ttft, itl, e2e = f.ttft.snapshot(), f.itl.snapshot(), f.e2e.snapshot()
    assert (ttft.count, ttft.sum) == (1, pytest.approx(0.5))
    assert (itl.count, itl.sum) == (3, pytest.approx(0.6))
    assert (e2e.count, e2e.sum) == (1, pytest.approx(2.0))
    assert f.generation_tokens == 4 and f.finished["length"] == 1
    assert f.finished_prompt_tokens == 3
    assert f.tokens_per_second(now=2.0) == pytest.approx(2.0)


def test_router_figures_reason_of_a_request():
    f = RouterFigures(started=0.0)
    stopped, cancelled, failed = _request(n=2), _request(), _request()
    stopped.choices[0].finish_reason = FinishReason.STOP
    stopped.choices[1].finish_reason = FinishReason.STOP
    cancelled.choices[0].finish_reason = FinishReason.CANCELLED
    failed.choices[0].finish_reason = FinishReason.CANCELLED
    f.mark_failed(failed)
    assert [f.on_finished(r) for r in (stopped, cancelled, failed)] == ["stop", "cancelled", "error"]
    assert f.finished == {"stop": 1, "length": 0, "cancelled": 1, "error": 1}
    assert f.e2e.snapshot().count == 0  # never submitted: no duration


def test_router_figures_step_phases():
    f = RouterFigures(started=0.0)
    f.on_step(0.3, (StepEntry(1, EntryKind.PREFILL, (1, 2), True), StepEntry(2, EntryKind.DECODE, (3,), True)))
    f.on_step(0.1, (StepEntry(2, EntryKind.DECODE, (4,), True),))
    f.on_step(0.001, ())  # sequence ops only (removes after a request): neither kind of step
    assert f.prefill_step.snapshot().count == 1 and f.decode_step.snapshot().count == 1
