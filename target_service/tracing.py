"""What the target's step span says: attributes from the step's domain request and result."""

from opentelemetry.trace import Span

from tandem.ops import EntryKind, StepRequest, StepResult

STEP_SPAN = "tandem.v1.TargetEngine/Step"


def describe_step(span: Span, request: StepRequest, result: StepResult | None = None) -> None:
    if not span.is_recording():
        return
    entries = request.entries
    span.set_attributes({
        "tandem.step_id": request.step_id,
        "tandem.draft_step_id": request.draft_step_id,
        "tandem.batch_size": len(entries),
        "tandem.seq_ids": [e.seq_id for e in entries],
        "tandem.ops": len(request.ops),
        "tandem.prefill_tokens": sum(len(e.token_ids) for e in entries if e.kind is EntryKind.PREFILL),
        "tandem.draft_tokens": sum(e.num_draft_tokens for e in entries),
    })
    if result is not None:
        span.set_attributes({
            "tandem.accepted_tokens": sum(r.num_accepted for r in result.results),
            "tandem.kv_pages_free": result.kv_pages_free,
            "tandem.compute_ms": result.compute_ms,
        })
