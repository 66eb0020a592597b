"""The router's figures of requests (DESIGN.md section 1: the router owns the metrics of
requests): time to first token, inter-token latency, request duration, step times, tokens
streamed, finished requests by reason, and one snapshot of all it knows for /metrics and the
Stats RPC alike. Pure: no gRPC, no HTTP.

Words: a step is a prefill step when it runs any prompt tokens, else a decode step. The
inter-token latency is observed once per token after a sequence's first: a step that emits n
tokens of a sequence dt after its previous tokens counts n gaps of dt / n (speculation emits
several tokens per step), so its sum is decode time and its count tokens.
"""

import time
from dataclasses import dataclass, field

from router.request import FinishReason, Request, Sequence
from tandem.figures import Histogram, HistogramSnapshot, RecentRate, hit_rate
from tandem.ops import EntryKind, StepEntry

FINISH_REASONS = ("stop", "length", "cancelled", "error")


class RouterFigures:
    """Owned by the router engine, recorded on its event loop. The scheduler counts its own
    events (preemptions, re-prefills) and the speculator its draft calls; `snapshot` reads all."""

    def __init__(self, started: float | None = None):
        self.started = time.monotonic() if started is None else started
        self.requests_total = 0
        self.requests_refused_total = 0  # the queue was full (max_waiting)
        self.prompt_tokens_total = 0
        self.cached_prompt_tokens_total = 0  # of finished requests
        self.completion_tokens_total = 0  # of finished requests
        self.steps_total = 0
        self.step_errors_total = 0
        self.step_ms_total = 0.0
        self.target_compute_ms_total = 0.0
        self.kv_mirror_mismatches = 0  # steps after which the router's page view differed: a bug
        self.target_restarts = 0  # targets found restarted between steps (instance_id)
        self.ttft = Histogram()
        self.itl = Histogram()
        self.e2e = Histogram()
        self.prefill_step = Histogram()
        self.decode_step = Histogram()
        self.generation_tokens = 0
        self.finished = dict.fromkeys(FINISH_REASONS, 0)
        self.finished_prompt_tokens = 0  # of finished requests: the hit rate's denominator
        self._recent = RecentRate(self.started)
        self._arrived: dict[Request, float] = {}
        self._first_token: set[Request] = set()
        self._last_token: dict[Sequence, float] = {}
        self._failed: set[Request] = set()

    def on_submit(self, request: Request, now: float | None = None) -> None:
        self._arrived[request] = _now(now)
        self.requests_total += 1
        self.prompt_tokens_total += len(request.spec.prompt_ids)

    def on_step(self, seconds: float, entries: tuple[StepEntry, ...], compute_ms: float = 0.0) -> None:
        """A target step's wall time and the target's compute time in it; a step of sequence ops
        only (no entries) neither prefilled nor decoded and is not observed."""
        self.steps_total += 1
        self.step_ms_total += seconds * 1e3
        self.target_compute_ms_total += compute_ms
        if not entries:
            return
        prefill = any(e.kind is EntryKind.PREFILL for e in entries)
        (self.prefill_step if prefill else self.decode_step).observe(seconds)

    def on_tokens(self, seq: Sequence, n: int, now: float | None = None) -> None:
        """A step emitted n tokens of `seq` to its client."""
        if n <= 0:
            return
        now = _now(now)
        self.generation_tokens += n
        self._recent.add(n, now)
        request = seq.request
        if request not in self._first_token and request in self._arrived:
            self._first_token.add(request)
            self.ttft.observe(now - self._arrived[request])
        last = self._last_token.get(seq)
        if last is None:
            if n > 1:
                self.itl.observe(0.0, n - 1)  # tokens that came with the first one
        else:
            self.itl.observe((now - last) / n, n)
        self._last_token[seq] = now

    def mark_failed(self, request: Request) -> None:
        """The request ends with an error (a failed step, a target that is down)."""
        self._failed.add(request)

    def on_finished(self, request: Request, now: float | None = None) -> str:
        """Counts the request by its reason and forgets it; returns the reason."""
        reason = _reason(request, request in self._failed)
        self.finished[reason] += 1
        self.completion_tokens_total += sum(len(s.output_ids) for s in request.choices)
        self.cached_prompt_tokens_total += request.cached_prompt_tokens
        self.finished_prompt_tokens += len(request.spec.prompt_ids)
        arrived = self._arrived.pop(request, None)
        if arrived is not None:
            self.e2e.observe(_now(now) - arrived)
        self._first_token.discard(request)
        self._failed.discard(request)
        for seq in request.choices:
            self._last_token.pop(seq, None)
        return reason

    def tokens_per_second(self, now: float | None = None) -> float:
        return self._recent.rate(_now(now))


def _reason(request: Request, failed: bool) -> str:
    """One reason for a request of n choices: error, else cancelled, else length, else stop."""
    reasons = {s.finish_reason for s in request.choices}
    if failed:
        return "error"
    if FinishReason.CANCELLED in reasons or None in reasons:
        return "cancelled"
    return "length" if FinishReason.LENGTH in reasons else "stop"


def _now(now: float | None) -> float:
    return time.monotonic() if now is None else now


@dataclass(frozen=True, slots=True)
class RouterSnapshot:
    """Everything the router reports, at one moment; field names are StatsResponse's."""

    requests_total: int
    requests_running: int
    requests_waiting: int  # the queue depth
    sequences_running: int
    sequences_waiting: int
    sequences_live: int
    sequences_recycled: int
    prompt_tokens_total: int
    cached_prompt_tokens_total: int
    prefix_cache_hit_rate: float
    completion_tokens_total: int
    generation_tokens_total: int
    tokens_per_second: float
    uptime_s: float
    steps_total: int
    step_errors_total: int
    preemptions_total: int
    target_restarts_total: int
    requests_refused_total: int
    kv_pages_total: int
    kv_pages_free: int
    kv_pages_used: int
    draft_tokens_total: int
    accepted_draft_tokens_total: int
    draft_failures_total: int
    respeculations_total: int
    mean_accepted_length: float
    proposed_by_position: tuple[int, ...]
    accepted_by_position: tuple[int, ...]
    acceptance_by_position: tuple[float, ...]
    speculation_active: bool
    step_ms_total: float
    target_compute_ms_total: float
    draft_ms_total: float
    draft_compute_ms_total: float
    spec_paused_steps_total: int
    finished_by_reason: dict[str, int] = field(default_factory=dict)
    time_to_first_token: HistogramSnapshot | None = None
    inter_token_latency: HistogramSnapshot | None = None
    request_duration: HistogramSnapshot | None = None
    prefill_step: HistogramSnapshot | None = None
    decode_step: HistogramSnapshot | None = None


def snapshot(engine, now: float | None = None) -> RouterSnapshot:
    """The router engine's figures now. Read on its event loop (Stats) or, racing it
    harmlessly, on a scrape's thread (each figure is read once)."""
    now = _now(now)
    f = engine.figures
    sched = engine.scheduler
    spec = engine.speculator.stats if engine.speculator else None
    running, waiting = list(sched.running), list(sched.waiting)
    return RouterSnapshot(
        requests_total=f.requests_total,
        requests_running=len({id(s.request) for s in running}),
        requests_waiting=len({id(s.request) for s in waiting}),
        sequences_running=len(running),
        sequences_waiting=len(waiting),
        sequences_live=sched.kv.held,
        sequences_recycled=sched.kv.cache.num_recycled(),
        prompt_tokens_total=f.prompt_tokens_total,
        cached_prompt_tokens_total=f.cached_prompt_tokens_total,
        prefix_cache_hit_rate=hit_rate(f.cached_prompt_tokens_total, f.finished_prompt_tokens),
        completion_tokens_total=f.completion_tokens_total,
        generation_tokens_total=f.generation_tokens,
        tokens_per_second=f.tokens_per_second(now),
        uptime_s=now - f.started,
        steps_total=f.steps_total,
        step_errors_total=f.step_errors_total,
        preemptions_total=sched.preempted_total,
        target_restarts_total=f.target_restarts,
        requests_refused_total=f.requests_refused_total,
        draft_failures_total=spec.draft_failures if spec else 0,
        respeculations_total=sched.respeculated_total,
        kv_pages_total=engine.info.kv_pages_total,
        kv_pages_free=engine.kv_pages_free,
        kv_pages_used=engine.info.kv_pages_total - engine.kv_pages_free,
        **_speculation(spec),
        speculation_active=bool(engine.speculator and engine.speculator.healthy),
        step_ms_total=f.step_ms_total,
        target_compute_ms_total=f.target_compute_ms_total,
        finished_by_reason=dict(f.finished),
        time_to_first_token=f.ttft.snapshot(),
        inter_token_latency=f.itl.snapshot(),
        request_duration=f.e2e.snapshot(),
        prefill_step=f.prefill_step.snapshot(),
        decode_step=f.decode_step.snapshot(),
    )


def _speculation(spec) -> dict:
    """The speculator's SpecStats as snapshot fields (None: no draft service, plain decoding)."""
    if spec is None:
        return dict(draft_tokens_total=0, accepted_draft_tokens_total=0, mean_accepted_length=1.0,
                    proposed_by_position=(), accepted_by_position=(), acceptance_by_position=(),
                    draft_ms_total=0.0, draft_compute_ms_total=0.0, spec_paused_steps_total=0)
    return dict(
        draft_tokens_total=spec.draft_tokens,
        accepted_draft_tokens_total=spec.accepted_tokens,
        mean_accepted_length=spec.mean_accepted_length,
        proposed_by_position=tuple(spec.proposed_at),
        accepted_by_position=tuple(spec.accepted_at),
        acceptance_by_position=tuple(spec.acceptance_by_position()),
        draft_ms_total=spec.draft_ms,
        draft_compute_ms_total=spec.draft_compute_ms,
        spec_paused_steps_total=spec.paused_steps,
    )
