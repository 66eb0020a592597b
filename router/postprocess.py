"""What a target step did to the sequences, in one place: the KV view follows what the target
kept, each choice that sampled turns its tokens into a delta (router/output.py), keeps the last
one as its next decode input or finishes, and counts the drafts its client got. Returns what to
stream. Pure: no gRPC, no asyncio.
"""

from collections.abc import Iterable
from dataclasses import dataclass

from router.request import Delta, Sequence
from router.scheduler import Scheduler
from router.step_plan import StepPlan
from tandem.ops import EntryResult, StepEntry


@dataclass(frozen=True, slots=True)
class Emitted:
    """One choice's share of a step, for its stream."""

    seq: Sequence
    delta: Delta


@dataclass(frozen=True, slots=True)
class StepOutput:
    emitted: tuple[Emitted, ...]
    kv_diverged: bool  # the router's page view differs from the target's: a bug


def postprocess(sched: Scheduler, plan: StepPlan, results: Iterable[EntryResult], target_free: int) -> StepOutput:
    by_seq = {r.seq_id: r for r in results}
    for entry, seq in zip(plan.entries, plan.seqs):
        sched.on_result(seq, entry, by_seq[entry.seq_id])
    # Ops queued while the step ran (a cancel) are still to be sent: the views differ till then.
    diverged = not sched.has_pending_ops() and sched.kv.free_pages != target_free
    emitted = []
    for entry, seq in zip(plan.entries, plan.seqs):
        outcome = by_seq[entry.seq_id]
        if seq.finished or not outcome.tokens or seq.output is None:
            continue  # cancelled while the step ran, a chunk with prompt left, a parent
        delta = seq.output.process(outcome.tokens)
        _count_drafts(seq, entry, min(outcome.num_accepted, len(delta.tokens)))
        if seq.finished:
            sched.finish(seq)
        else:
            seq.pending_token = delta.tokens[-1].token_id
        emitted.append(Emitted(seq, delta))
    return StepOutput(tuple(emitted), diverged)


def _count_drafts(seq: Sequence, entry: StepEntry, accepted: int) -> None:
    """Usage counts what the client got: drafts after a stop are not accepted tokens."""
    seq.draft_tokens += entry.num_draft_tokens
    seq.accepted_draft_tokens += accepted
    if not entry.num_draft_tokens:
        return
    seq.verify_steps += 1
    while len(seq.accepted_by_depth) < accepted:
        seq.accepted_by_depth.append(0)
    for i in range(accepted):
        seq.accepted_by_depth[i] += 1
