"""The scheduler tests' helpers. `run` plays the engine's part of a step: commit the plan, report
each entry's result, then what the output processor does with a sampled token (count it as
output, leave it pending for the next decode). The fake model samples FIRST, FIRST + 1, ... for
every sequence, so each literal decode names how far its sequence got."""

from router.limits import EngineLimits
from router.request import FinishReason, GenerationSpec, Request, new_request
from router.scheduler import Scheduler
from router.step_plan import StepPlan
from tandem.ops import EntryKind, EntryResult, SampledToken, StepEntry
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
