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


class _LinearSoftCrossEntropy(torch.autograd.Function):
    """sum over rows of KL(softmax(teacher @ weight.T) || softmax(hidden @ weight.T)): the token
    loss against the target's next-token distribution (EAGLE-3's and HASS's distillation) instead
    of its greedy token. The teacher's logits come from its own final-norm features through the
    same lm_head rows (a pruned vocabulary's: the target's distribution renormalised on it),
    recomputed per chunk in the backward."""

    @staticmethod
    def forward(ctx, hidden, weight, teacher):
        total = torch.zeros((), dtype=torch.float32)
        lse = torch.empty(hidden.shape[0], dtype=torch.float32)
        for start in range(0, hidden.shape[0], CHUNK_ROWS):
            rows = slice(start, start + CHUNK_ROWS)
            logits = (hidden[rows] @ weight.T).float()
            lse[rows] = torch.logsumexp(logits, dim=-1)
            log_p = torch.log_softmax((teacher[rows] @ weight.T).float(), dim=-1)
            # KL = sum p (log p - log q), log q = logits - lse
            total += (log_p.exp() * (log_p - logits)).sum() + lse[rows].sum()
        ctx.save_for_backward(hidden, weight, teacher, lse)
        return total

    @staticmethod
    def backward(ctx, grad_total):
        hidden, weight, teacher, lse = ctx.saved_tensors
        grad_hidden = torch.zeros_like(hidden)
        for start in range(0, hidden.shape[0], CHUNK_ROWS):
            rows = slice(start, start + CHUNK_ROWS)
            q = torch.sub(hidden[rows] @ weight.T, lse[rows, None]).exp_()
            q -= torch.softmax((teacher[rows] @ weight.T).float(), dim=-1)
            grad_hidden[rows] = q.mul_(grad_total).to(hidden.dtype) @ weight
        return grad_hidden, None, None


def linear_soft_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """hidden [T, D] (the draft's features), weight [V, D] (frozen), teacher [T, D] (the target's
    features, no gradient) -> the mean over rows of KL(target's distribution || draft's)."""
    assert hidden.shape == teacher.shape and weight.shape[1] == hidden.shape[1]
    weight = weight.to(hidden.dtype)
    return _LinearSoftCrossEntropy.apply(hidden, weight, teacher.detach().to(hidden.dtype)) / max(hidden.shape[0], 1)


@torch.no_grad()
def top1_hits(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """[T] bool: the row's best entry of hidden @ weight.T is its label (IGNORE: False)."""
    return (chunked_topk(hidden, weight, 1)[:, 0] == labels) & (labels != IGNORE)


@torch.no_grad()
def sampled_acceptance(hidden: torch.Tensor, weight: torch.Tensor, teacher: torch.Tensor, teacher_weight: torch.Tensor,
                       columns: torch.Tensor | None) -> torch.Tensor:
    """[T]: the chance that speculative sampling at temperature 1 accepts the draft's token, sum_x
    min(p(x), q(x)) = 1 - TV(p, q), with q = softmax(hidden @ weight.T) over the draft vocabulary
    (its column j is target token columns[j]; None: the whole vocabulary) and p =
    softmax(teacher @ teacher_weight.T) the target's whole distribution (mass outside the draft
    vocabulary can never be accepted)."""
    out = torch.empty(hidden.shape[0], dtype=torch.float32)
    weight, teacher, teacher_weight = weight.to(hidden.dtype), teacher.to(hidden.dtype), teacher_weight.to(hidden.dtype)
    for start in range(0, hidden.shape[0], CHUNK_ROWS):
        rows = slice(start, start + CHUNK_ROWS)
        q = torch.softmax((hidden[rows] @ weight.T).float(), dim=-1)
        p = torch.softmax((teacher[rows] @ teacher_weight.T).float(), dim=-1)
        out[rows] = torch.minimum(p if columns is None else p[:, columns], q).sum(-1)
    return out


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
