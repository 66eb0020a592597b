"""The figures a service keeps about itself, for its /metrics endpoint and its Stats RPC alike:
histograms with fixed buckets (Prometheus's model, so both report the same numbers), a rate over
a recent window, and what a model engine did per step. Pure: no gRPC, no HTTP.

The owner records from its own thread; a scrape may snapshot from another, hence the locks.
"""

import bisect
import math
import threading
import time
from collections import deque
from dataclasses import dataclass, replace

from tandem.ops import EngineStats, EntryKind, LatencySummary, StepEntry

# 1-2-5 steps from 0.5 ms (a GPU decode step, one inter-token gap) to 500 s (a long request on
# a CPU): one set of buckets for every latency, on either kind of machine.
LATENCY_BUCKETS_S = (
    0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5,
    1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0,
)
RATE_WINDOW_S = 60.0


@dataclass(frozen=True, slots=True)
class HistogramSnapshot:
    bounds: tuple[float, ...]  # upper bounds, ascending; a last +Inf bucket is implied
    counts: tuple[int, ...]  # observations per bucket (not cumulative), len(bounds) + 1
    sum: float

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> list[int]:
        out, total = [], 0
        for c in self.counts:
            total += c
            out.append(total)
        return out

    def quantile(self, q: float) -> float:
        """Prometheus's histogram_quantile: linear within the bucket that holds rank q * count
        (the first bucket starts at 0); in the +Inf bucket, the largest finite bound. 0 when empty."""
        assert 0.0 <= q <= 1.0, q
        total = self.count
        if total == 0:
            return 0.0
        rank = q * total
        below = 0
        for i, c in enumerate(self.counts):
            if c and below + c >= rank:
                if i == len(self.bounds):
                    return self.bounds[-1]
                lower = self.bounds[i - 1] if i else 0.0
                return lower + (self.bounds[i] - lower) * (rank - below) / c
            below += c
        return self.bounds[-1]

    def summary(self) -> LatencySummary:
        return LatencySummary(self.count, self.sum, self.quantile(0.5), self.quantile(0.9), self.quantile(0.99))


class Histogram:
    def __init__(self, bounds: tuple[float, ...] = LATENCY_BUCKETS_S):
        assert list(bounds) == sorted(set(bounds)) and bounds, bounds
        self.bounds = tuple(bounds)
        self._counts = [0] * (len(bounds) + 1)
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe(self, value: float, times: int = 1) -> None:
        """`times` observations of `value` (a step that emitted n tokens: n gaps of dt / n)."""
        i = bisect.bisect_left(self.bounds, value)  # the first bound >= value (le is inclusive)
        with self._lock:
            self._counts[i] += times
            self._sum += value * times

    def snapshot(self) -> HistogramSnapshot:
        with self._lock:
            return HistogramSnapshot(self.bounds, tuple(self._counts), self._sum)


class RecentRate:
    """Events per second over the last `window_s` seconds (or since `started`, if sooner).
    Events are kept summed per whole second: the router adds one per sequence per step, which
    would otherwise keep (and sum at each scrape) a minute of entries at any batch size."""

    def __init__(self, started: float, window_s: float = RATE_WINDOW_S):
        self.started = started
        self.window_s = window_s
        self._events: deque[list] = deque()  # [second, events in it], seconds ascending
        self._lock = threading.Lock()

    def add(self, n: int, now: float) -> None:
        second = math.floor(now)
        with self._lock:
            if self._events and self._events[-1][0] == second:
                self._events[-1][1] += n
            else:
                self._events.append([second, n])
            self._trim(now)

    def rate(self, now: float) -> float:
        with self._lock:
            self._trim(now)
            total = sum(n for _, n in self._events)
        span = min(self.window_s, now - self.started)
        return total / span if span > 0 else 0.0

    def _trim(self, now: float) -> None:
        while self._events and self._events[0][0] < now - self.window_s:
            self._events.popleft()


def hit_rate(hits: int, total: int) -> float:
    """hits / total, 0 when nothing was asked (prefix cache: cached prompt tokens / prompt tokens)."""
    return hits / total if total else 0.0


class EngineFigures:
    """What a model engine (target or draft) did: its steps' compute time and tokens by kind.
    Steps, KV pages and sequences its EngineStats already count."""

    def __init__(self, started: float | None = None):
        self.started = time.monotonic() if started is None else started
        self.step_seconds = Histogram()
        self.prefill_tokens = 0  # target: prompt tokens run
        self.decode_tokens = 0  # target: decode inputs run, a verify's drafts included
        self.verified_draft_tokens = 0  # target: draft tokens scored by verification
        self.proposed_draft_tokens = 0  # draft: draft tokens returned to the router
        self._recent = RecentRate(self.started)

    def record_step(self, seconds: float, entries: tuple[StepEntry, ...] = (), proposed: int = 0,
                    now: float | None = None) -> None:
        self.step_seconds.observe(seconds)
        prefill = sum(len(e.token_ids) for e in entries if e.kind is EntryKind.PREFILL)
        decode = sum(len(e.token_ids) for e in entries if e.kind is EntryKind.DECODE)
        self.prefill_tokens += prefill
        self.decode_tokens += decode
        self.verified_draft_tokens += sum(e.num_draft_tokens for e in entries)
        self.proposed_draft_tokens += proposed
        self._recent.add(prefill + decode + proposed, time.monotonic() if now is None else now)

    def fill(self, stats: EngineStats, now: float | None = None) -> EngineStats:
        """The engine's stats with these figures added."""
        now = time.monotonic() if now is None else now
        return replace(
            stats,
            prefill_tokens_total=self.prefill_tokens,
            decode_tokens_total=self.decode_tokens,
            verified_draft_tokens_total=self.verified_draft_tokens,
            proposed_draft_tokens_total=self.proposed_draft_tokens,
            step_seconds=self.step_seconds.snapshot().summary(),
            uptime_s=now - self.started,
            tokens_per_second=self._recent.rate(now),
        )
