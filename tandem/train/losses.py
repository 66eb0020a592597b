"""Losses and metrics shared by the draft methods.

The token loss runs an lm_head of up to 49k rows over thousands of positions: [T, V] fp32 logits
would take gigabytes, so `linear_cross_entropy` works in chunks of rows and recomputes each
chunk's logits in the backward pass instead of keeping them (memory: one chunk's logits).
"""

import torch

CHUNK_ROWS = 1024
IGNORE = -100


class _LinearCrossEntropy(torch.autograd.Function):
    """sum over rows with label != IGNORE of CE(hidden @ weight.T, label), and per-row top-1 hits
    (when asked: the argmax is a pass over [T, V] of its own). Each pass over a chunk's [rows, V]
    logits costs tens of ms here, so the backward works in place."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, with_hits: bool):
        total = torch.zeros((), dtype=torch.float32)
        lse = torch.empty(hidden.shape[0], dtype=torch.float32)
        hits = torch.zeros(hidden.shape[0], dtype=torch.bool)
        valid = labels != IGNORE
        for start in range(0, hidden.shape[0], CHUNK_ROWS):
            rows = slice(start, start + CHUNK_ROWS)
            logits = hidden[rows] @ weight.T
            lse[rows] = torch.logsumexp(logits.float(), dim=-1)
            picked = logits.gather(1, labels[rows].clamp(min=0)[:, None]).squeeze(1).float()
            total += ((lse[rows] - picked) * valid[rows]).sum()
            if with_hits:
                hits[rows] = (logits.argmax(-1) == labels[rows]) & valid[rows]
        ctx.save_for_backward(hidden, weight, labels, lse)
        ctx.mark_non_differentiable(hits)
        return total, hits

    @staticmethod
    def backward(ctx, grad_total, _grad_hits):
        hidden, weight, labels, lse = ctx.saved_tensors
        grad_hidden = torch.zeros_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        scale = (labels != IGNORE) * grad_total
        for start in range(0, hidden.shape[0], CHUNK_ROWS):
            rows = slice(start, start + CHUNK_ROWS)
            probs = torch.sub(hidden[rows] @ weight.T, lse[rows, None]).exp_()  # softmax, fp32
            probs[torch.arange(probs.shape[0]), labels[rows].clamp(min=0)] -= 1.0
            probs = probs.mul_(scale[rows, None]).to(hidden.dtype)
            if grad_hidden is not None:
                grad_hidden[rows] = probs @ weight
            if grad_weight is not None:
                grad_weight += (probs.T @ hidden[rows]).float()
        return grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype), None, None


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *, with_hits: bool = True):
    """hidden [T, D], weight [V, D], labels [T] int64 (IGNORE: no loss) -> (mean CE over
    labelled rows, top-1 hits [T] bool (all False unless with_hits), labelled rows)."""
    assert hidden.dim() == 2 and weight.shape[1] == hidden.shape[1] and labels.shape == hidden.shape[:1]
    total, hits = _LinearCrossEntropy.apply(hidden, weight.to(hidden.dtype), labels, with_hits)
    count = int((labels != IGNORE).sum())
    return total / max(count, 1), hits, count


@torch.no_grad()
def chunked_topk(hidden: torch.Tensor, weight: torch.Tensor, k: int) -> torch.Tensor:
    """hidden [T, D], weight [V, D] -> the k best rows of hidden @ weight.T, best first, [T, k] int64."""
    out = torch.empty(hidden.shape[0], k, dtype=torch.long)
    w = weight.to(hidden.dtype)
    for start in range(0, hidden.shape[0], CHUNK_ROWS):
        out[start : start + CHUNK_ROWS] = (hidden[start : start + CHUNK_ROWS] @ w.T).topk(k, dim=-1).indices
    return out


def accepted_lengths(matches: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
    """matches [S, N, L] bool: draft step s from anchor (n, i) equals the target's token;
    anchors [N, L] bool: where a chain starts. Returns the tokens one verify step yields from
    each anchor, greedy: 1 (the target's own bonus / correction) + the accepted prefix, [A]."""
    leading = torch.cumprod(matches.long(), dim=0).sum(0)
    return (1 + leading)[anchors]


def shifted(x: torch.Tensor, by: int, fill=0) -> torch.Tensor:
    """x [N, L, ...] shifted left along dim 1: out[:, i] = x[:, i + by], `fill` past the end."""
    if by == 0:
        return x
    out = torch.full_like(x, fill)
    if by < x.shape[1]:
        out[:, : x.shape[1] - by] = x[:, by:]
    return out
