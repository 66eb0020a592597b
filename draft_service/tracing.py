"""What the draft's Draft span says: attributes from the call's domain request and result."""

from opentelemetry.trace import Span

from tandem.ops import DraftRequest, DraftResult

DRAFT_SPAN = "tandem.v1.DraftEngine/Draft"


def describe_draft(span: Span, request: DraftRequest, result: DraftResult | None = None) -> None:
    if not span.is_recording():
        return
    span.set_attributes({
        "tandem.draft_step_id": request.draft_step_id,
        "tandem.after_target_step": request.after_target_step,
        "tandem.batch_size": len(request.seqs),
        "tandem.seq_ids": [s.seq_id for s in request.seqs],
        "tandem.ops": len(request.ops),
    })
    if result is not None:
        span.set_attributes({
            "tandem.draft_tokens": sum(len(t) for t in result.tokens.values()),
            "tandem.compute_ms": result.compute_ms,
        })
