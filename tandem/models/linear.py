"""A projection in nn.Linear's [out, in] layout, with the CPU kernel chosen by the number of rows.

A decode step projects one row per sequence, a verify step a handful (the root and the drafted
tokens), a batch of decodes one per sequence. On CPU each row count has its own fastest kernel,
and which one differs from one processor to another: a matrix-vector product, `F.linear`, or
oneDNN over a copy of the weight reordered once into its blocked layout (fp32; it doubles the
weights' memory, which on CPU is the small default model's). So a model holds a KernelPlan
(tandem.models.kernel_plan) for 1 to MAX_FLAT_ROWS rows, timed on its own projections when it
loads (`calibrate_cpu_kernels`, on the thread that will run them) or given by --cpu-kernels;
more rows always take the blocked copy. CUDA takes `F.linear` for any row count, as nn.Linear.
The timings behind this: bench/results/notes/2026-12-03-cpu-kernels-by-row-count.md.
"""

import logging
import time
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from tandem.cpu_load import BusyClock, others_busy_s, resolution_s
from tandem.models.kernel_plan import CPU_KERNELS, DEFAULT_PLAN, MAX_FLAT_ROWS, KernelPlan

log = logging.getLogger(__name__)

QUIET_SHARE = 0.25  # of one core: more CPU taken by other processes while timing kernels times them again
CALIBRATION_ATTEMPTS = 4


@dataclass(frozen=True, slots=True)
class Linear:
    weight: torch.Tensor  # [out, in] contiguous
    bias: torch.Tensor | None = None  # [out]
    blocked: torch.Tensor | None = None  # oneDNN's reordered copy of weight (CPU, fp32)
    plan: KernelPlan = DEFAULT_PLAN  # the CPU kernel for each row count, the model's

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, in] -> [M, out]."""
        return self.run(self.plan.kernel(x.shape[0]), x)

    def run(self, kernel: str, x: torch.Tensor) -> torch.Tensor:
        """x through `kernel` where it applies (the blocked copy exists; a matrix-vector product
        of one CPU row), else F.linear."""
        if kernel == "blocked" and self.blocked is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.blocked, self.bias, "none", [], "")
        if kernel == "matvec" and x.shape[0] == 1 and x.device.type == "cpu":
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
    bias: torch.Tensor | None = None  # [out], in the model's dtype

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, in] -> [M, out] in x's dtype."""
        y = torch._weight_int8pack_mm(x.to(torch.bfloat16), self.weight, self.scales).to(x.dtype)
        return y if self.bias is None else y + self.bias


def quantize_int8(weight: torch.Tensor, bias: torch.Tensor | None = None) -> Int8Linear:
    """weight [out, in] (CPU) -> its symmetric per-row int8 quantization; the bias is kept."""
    if weight.device.type != "cpu":
        raise ValueError(f"int8 projections run on CPU only, not {weight.device}")
    w = weight.float()
    wanted = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-30)
    # The kernel takes bf16 scales: round each up to one bf16 holds, then quantize against it, so
    # the scale is exact and the row's largest weight still fits in 127.
    scales = wanted.to(torch.bfloat16)
    scales = torch.where(scales.float() < wanted, torch.nextafter(scales, torch.full_like(scales, float("inf"))), scales)
    q = torch.round(w / scales.float()[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
    return Int8Linear(q, scales, None if bias is None else bias.contiguous())


def make_linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> Linear:
    """weight [out, in] (any layout); the blocked copy where oneDNN can serve it."""
    weight = weight.contiguous()
    blocked = None
    if weight.device.type == "cpu" and weight.dtype == torch.float32 and torch.backends.mkldnn.is_available():
        blocked = torch.ops.mkldnn._reorder_linear_weight(weight, MAX_FLAT_ROWS + 1)
    return Linear(weight, None if bias is None else bias.contiguous(), blocked)


def make_head_projection(weight: torch.Tensor, int8: bool, bias: torch.Tensor | None = None) -> Linear | Int8Linear:
    """A draft's projection: int8 (CPU; see Int8Linear) or as make_linear gives it."""
    return quantize_int8(weight, bias) if int8 else make_linear(weight, bias)


def with_plan(projection, plan: KernelPlan):
    """The projection running `plan`'s CPU kernels (the same tensors); an Int8Linear as it is."""
    return replace(projection, plan=plan) if isinstance(projection, Linear) else projection


def choose_kernels(given: KernelPlan | None, device, linears: list[Linear]) -> KernelPlan:
    """`given` (--cpu-kernels) where there is one, else on CPU the plan timed on these
    projections (calibrate_cpu_kernels), else DEFAULT_PLAN (a GPU runs F.linear whatever it says)."""
    if given is not None:
        return given
    if torch.device(device).type != "cpu" or not linears:
        return DEFAULT_PLAN
    plan = calibrate_cpu_kernels(linears)
    log.info("CPU kernels for 1..%d rows: %s", MAX_FLAT_ROWS, plan)
    return plan


def calibrate_cpu_kernels(linears: list[Linear], repeats: int = 3, others_clock: BusyClock = others_busy_s) -> KernelPlan:
    """Times every kernel that applies over all of `linears` (a model's projections: their real
    sizes and memory traffic) for 1..MAX_FLAT_ROWS rows, the best of `repeats` interleaved
    passes, and returns the fastest for each row count (about a second for the default model).

    Other processes computing at the same time skew the choice, and it lasts the model's life:
    on a 2-core AMD EPYC with another process multiplying matrices, 7 calibrations in 8 chose a
    one-row kernel 3x slower than the blocked one
    (bench/results/notes/2026-12-06-cpu-kernels-int8-lm-head.md). So while others took more than
    QUIET_SHARE of a core's time (beyond what the busy clock's ticks blur over a short timing:
    tandem.cpu_load.resolution_s), it measures again, up to CALIBRATION_ATTEMPTS times, then
    keeps the last choice with a warning."""
    for attempt in range(1, CALIBRATION_ATTEMPTS + 1):
        started, others = time.perf_counter(), others_clock()
        plan = _measure_cpu_kernels(linears, repeats)
        if others is None:
            break  # no way to tell (not Linux)
        wall = time.perf_counter() - started
        share = (others_clock() - others) / wall
        if share <= QUIET_SHARE + resolution_s() / wall:  # a short timing's figure is coarse
            break
        if attempt < CALIBRATION_ATTEMPTS:
            log.info("CPU kernels: other processes took %.0f%% of a core while they were timed; timing again", 100 * share)
        else:
            log.warning("CPU kernels %s were timed while other processes took %.0f%% of a core; if steps are slow,"
                        " fix them with --cpu-kernels (TANDEM_CPU_KERNELS, e.g. blocked,blocked,blocked)", plan, 100 * share)
    return plan


def _measure_cpu_kernels(linears: list[Linear], repeats: int) -> KernelPlan:
    """The fastest kernel for each of 1..MAX_FLAT_ROWS rows (see calibrate_cpu_kernels)."""
    candidates = [k for k in CPU_KERNELS if k != "blocked" or all(lin.blocked is not None for lin in linears)]
    plan = []
    for rows in range(1, MAX_FLAT_ROWS + 1):
        kernels = [k for k in candidates if k != "matvec" or rows == 1]
        inputs = {d: torch.randn(rows, d, dtype=linears[0].weight.dtype) for d in {lin.weight.shape[1] for lin in linears}}
        best = dict.fromkeys(kernels, float("inf"))
        for attempt in range(repeats + 1):
            for kernel in kernels:
                start = time.perf_counter()
                for lin in linears:
                    lin.run(kernel, inputs[lin.weight.shape[1]])
                if attempt:  # the first pass warms caches and oneDNN's primitives
                    best[kernel] = min(best[kernel], time.perf_counter() - start)
        plan.append(min(kernels, key=best.__getitem__))
    return KernelPlan(tuple(plan))
