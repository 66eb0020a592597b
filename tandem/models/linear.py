"""A projection in nn.Linear's [out, in] layout, with the CPU kernel chosen by the number of rows.

A decode step projects one row per sequence, a verify step a handful (the root and the drafted
tokens), a batch of decodes one per sequence. MKL's sgemm over [in, out] weights (`x @ w`, what
tandem did before) ran a 2-row verify of the 135M default model at 1.4x a 1-row step on this
machine's Xeon, eating most of what speculation saves. All the default model's matmuls, fp32,
2 threads, ms:

    rows                    1     2     3     4     8    16    64   256
    x @ w, [in, out]      21.6  30.4  35.6  37.8  51.3  59.9  89.6  272
    W @ x^T, [out, in]    21.8  58.0  56.3  59.4  57.8  52.2  96.8  265
    F.linear, [out, in]   22.9  24.6  26.5  42.0  53.1  53.4  95.5  276
    oneDNN, blocked copy  27.5  29.2  32.7  29.7  35.4  42.0  92.5  259

So on CPU: one row is a matrix-vector product, 2-3 rows go to `F.linear`, more to oneDNN over a
copy of the weight reordered once into its blocked layout (fp32; it doubles the weights' memory,
which on CPU is the small default model's). CUDA takes `F.linear` for any row count, as nn.Linear.

In the default model's whole forward (fp32, on a pool thread as the services run it) one row
takes 28.9 ms against 27.7 with `x @ w` over an [in, out] copy: 4% given up on a single stream,
which a third copy of every weight would buy back, for 22% on 2 rows and 8 rows.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

MAX_FLAT_ROWS = 3  # above this, the blocked copy where there is one


@dataclass(frozen=True, slots=True)
class Linear:
    weight: torch.Tensor  # [out, in] contiguous
    bias: torch.Tensor | None = None  # [out]
    blocked: torch.Tensor | None = None  # oneDNN's reordered copy of weight (CPU, fp32)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, in] -> [M, out]."""
        rows = x.shape[0]
        if self.blocked is not None and rows > MAX_FLAT_ROWS:
            return torch.ops.mkldnn._linear_pointwise(x, self.blocked, self.bias, "none", [], "")
        if rows == 1 and x.device.type == "cpu":
            y = (self.weight @ x.t()).t()  # a matrix-vector product; [out, 1] viewed as [1, out]
            return y if self.bias is None else y + self.bias
        return F.linear(x, self.weight, self.bias)


@dataclass(frozen=True, slots=True)
class Int8Linear:
    """A projection with int8 weights, one scale per output row (weight-only quantization), for
    a draft's lm_head on CPU: its rows are read once a draft step and are most of the step's
    bytes. On this machine's AVX2 EPYC, a 16k x 576 pruned lm_head over one row takes 0.4 ms
    against 3.9 ms in fp32 (the rows go through bf16, the kernel's input type). Rows are
    independent: a row's scores do not depend on the others in the call (fp32's kernels, chosen
    by row count, differ in the last bits), so seeded drafts are the same in any batch."""

    weight: torch.Tensor  # [out, in] int8
    scales: torch.Tensor  # [out] bf16: row r of the real weight is weight[r] * scales[r]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, in] -> [M, out] in x's dtype."""
        return torch._weight_int8pack_mm(x.to(torch.bfloat16), self.weight, self.scales).to(x.dtype)


def quantize_int8(weight: torch.Tensor) -> Int8Linear:
    """weight [out, in] (CPU) -> its symmetric per-row int8 quantization."""
    if weight.device.type != "cpu":
        raise ValueError(f"int8 projections run on CPU only, not {weight.device}")
    w = weight.float()
    wanted = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-30)
    # The kernel takes bf16 scales: round each up to one bf16 holds, then quantize against it, so
    # the scale is exact and the row's largest weight still fits in 127.
    scales = wanted.to(torch.bfloat16)
    scales = torch.where(scales.float() < wanted, torch.nextafter(scales, torch.full_like(scales, float("inf"))), scales)
    q = torch.round(w / scales.float()[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
    return Int8Linear(q, scales)


def make_linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> Linear:
    """weight [out, in] (any layout); the blocked copy where oneDNN can serve it."""
    weight = weight.contiguous()
    blocked = None
    if weight.device.type == "cpu" and weight.dtype == torch.float32 and torch.backends.mkldnn.is_available():
        blocked = torch.ops.mkldnn._reorder_linear_weight(weight, MAX_FLAT_ROWS + 1)
    return Linear(weight, None if bias is None else bias.contiguous(), blocked)


def make_head_projection(weight: torch.Tensor, int8: bool) -> Linear | Int8Linear:
    """A draft's lm_head: int8 (CPU; see Int8Linear) or as make_linear gives it."""
    return quantize_int8(weight) if int8 else make_linear(weight)
