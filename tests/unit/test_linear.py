"""Every row count takes a kernel (matrix-vector, F.linear, oneDNN's blocked copy); all of them
compute nn.Linear's product; the int8 projection for a draft's lm_head comes close to it."""

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from tandem.errors import InvalidArgument
from tandem.models.kernel_plan import DEFAULT_PLAN, KernelPlan, plan_from_flag
from tandem.models.linear import (CALIBRATION_ATTEMPTS, CPU_KERNELS, MAX_FLAT_ROWS, calibrate_cpu_kernels,
                                  choose_kernels, make_linear, quantize_int8, with_plan)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 2, MAX_FLAT_ROWS, MAX_FLAT_ROWS + 1, 8, 33])
def test_every_row_count_computes_the_linear_product(dtype, bias, rows):
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(48, 40, generator=g).to(dtype)
    b = torch.randn(48, generator=g).to(dtype) if bias else None
    x = torch.randn(rows, 40, generator=g).to(dtype)
    y = make_linear(weight, b)(x)
    assert y.shape == (rows, 48) and y.dtype == dtype
    tol = {} if dtype == torch.float32 else {"atol": 0.1, "rtol": 0.02}
    assert_close(y, F.linear(x, weight, b), **tol)


def test_fp32_on_cpu_keeps_a_blocked_copy_and_others_do_not():
    weight = torch.randn(16, 8)
    assert make_linear(weight).blocked is not None
    assert make_linear(weight.bfloat16()).blocked is None
    assert make_linear(weight.t()).weight.is_contiguous()  # any layout in, [out, in] contiguous kept


@pytest.mark.parametrize("rows", [1, 2, 8])
def test_strided_inputs_compute_the_same(rows):
    weight = torch.randn(48, 40)
    x = torch.randn(rows, 80)[:, ::2]  # every other column: not contiguous
    assert not x.is_contiguous()
    assert_close(make_linear(weight)(x), F.linear(x, weight))


def _scaled_weight(out: int, dim: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(out, dim, generator=g) * torch.rand(out, 1, generator=g)  # rows of different scales


def test_int8_projection_is_close_to_the_fp32_product():
    weight = _scaled_weight(300, 64, seed=1)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(2))
    exact, got = x @ weight.T, quantize_int8(weight)(x)
    assert got.shape == exact.shape and got.dtype == torch.float32
    assert (got - exact).abs().max() < 0.02 * exact.abs().max()
    assert not torch.equal(got, exact)  # it did quantize


def test_an_int8_projection_adds_its_bias():
    weight, bias = _scaled_weight(40, 16, seed=5), torch.randn(40)
    x = torch.randn(3, 16)
    q = quantize_int8(weight, bias)
    assert_close(q(x), quantize_int8(weight)(x) + bias)
    assert (q(x) - F.linear(x, weight, bias)).abs().max() < 0.02 * F.linear(x, weight).abs().max()


def test_int8_scales_are_exact_in_bf16_and_fit_each_row():
    weight = _scaled_weight(200, 32, seed=3)
    q = quantize_int8(weight)
    assert q.weight.dtype == torch.int8 and q.scales.dtype == torch.bfloat16
    assert q.weight.abs().amax(1).le(127).all() and q.weight.abs().amax(1).ge(126).all()  # full range used
    dequantized = q.weight.float() * q.scales.float()[:, None]
    assert (dequantized - weight).abs().le(q.scales.float()[:, None] / 2 + 1e-6).all()  # half a step at most


@pytest.mark.parametrize("rows", [2, 3, 8, 33])
def test_an_int8_row_does_not_depend_on_the_rest_of_its_batch(rows):
    q = quantize_int8(_scaled_weight(500, 64, seed=4))
    x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows))
    together = q(x)
    for i in range(rows):
        assert torch.equal(q(x[i : i + 1])[0], together[i])


def test_int8_projection_is_cpu_only():
    with pytest.raises(ValueError, match="CPU only"):
        quantize_int8(torch.empty(4, 4, device="meta"))


@pytest.mark.parametrize("kernel", CPU_KERNELS)
@pytest.mark.parametrize("rows", range(1, MAX_FLAT_ROWS + 1))
def test_every_cpu_kernel_a_plan_may_name_computes_the_product(kernel, rows):
    plan = KernelPlan((kernel,) * MAX_FLAT_ROWS)
    g = torch.Generator().manual_seed(rows)
    weight, bias, x = torch.randn(48, 40, generator=g), torch.randn(48, generator=g), torch.randn(rows, 40, generator=g)
    assert_close(with_plan(make_linear(weight, bias), plan)(x), F.linear(x, weight, bias))


def test_a_linear_runs_its_plans_kernel_for_each_row_count(monkeypatch):
    linear = with_plan(make_linear(torch.randn(8, 8)), KernelPlan(("blocked", "matvec", "flat")))
    ran = []
    monkeypatch.setattr(type(linear), "run", lambda self, kernel, x: ran.append(kernel))
    for rows in (1, 2, 3, MAX_FLAT_ROWS + 1):
        linear(torch.randn(rows, 8))
    assert ran == ["blocked", "matvec", "flat", "blocked"]
    assert make_linear(torch.randn(8, 8)).plan == DEFAULT_PLAN
    int8 = quantize_int8(torch.randn(8, 8))
    assert with_plan(int8, linear.plan) is int8  # its one kernel serves every row count


def test_calibration_picks_a_kernel_per_row_count_and_uses_it():
    linears = [make_linear(torch.randn(64, 32)), make_linear(torch.randn(32, 64))]
    plan = calibrate_cpu_kernels(linears, repeats=1)
    assert len(plan.by_rows) == MAX_FLAT_ROWS and set(plan.by_rows) <= set(CPU_KERNELS) and "matvec" not in plan.by_rows[1:]
    assert choose_kernels(None, "meta", linears) == DEFAULT_PLAN  # a GPU's: F.linear whatever the plan says
    bf16 = [make_linear(torch.randn(64, 32).bfloat16())]  # no blocked copy: never chosen
    assert "blocked" not in calibrate_cpu_kernels(bf16, repeats=1).by_rows


class _OthersClock:
    """Other processes' CPU seconds as calibration reads them (twice an attempt): `busy`
    attempts in which they took far more than a core, then quiet ones."""

    def __init__(self, busy: int):
        self.readings, self.busy, self.now = 0, busy, 0.0

    def __call__(self) -> float:
        self.readings += 1
        if self.readings % 2 == 0 and self.readings // 2 <= self.busy:
            self.now += 1000.0
        return self.now


def test_calibration_times_again_while_other_processes_compute(caplog):
    linears = [make_linear(torch.randn(64, 32))]
    clock = _OthersClock(busy=2)
    plan = calibrate_cpu_kernels(linears, repeats=1, others_clock=clock)
    assert clock.readings == 2 * 3 and isinstance(plan, KernelPlan)  # two busy attempts, then a quiet one
    assert not [r for r in caplog.records if r.levelname == "WARNING"]
    clock = _OthersClock(busy=CALIBRATION_ATTEMPTS)
    calibrate_cpu_kernels(linears, repeats=1, others_clock=clock)
    assert clock.readings == 2 * CALIBRATION_ATTEMPTS
    assert any(r.levelname == "WARNING" and "TANDEM_CPU_KERNELS" in r.getMessage() for r in caplog.records)


def test_calibration_allows_for_the_busy_clocks_ticks():
    """Other processes' time comes in clock ticks per CPU: under a tick on every CPU over a
    short timing (a small head's takes milliseconds) is no sign of load."""
    from tandem.cpu_load import resolution_s

    readings = []

    def ticks():  # others seem to take 90% of a tick on every CPU during each timing
        readings.append(1)
        return 0.9 * resolution_s() * (len(readings) // 2)

    calibrate_cpu_kernels([make_linear(torch.randn(8, 8))], repeats=1, others_clock=ticks)
    assert len(readings) == 2  # timed once


def test_calibration_without_a_busy_clock_measures_once():
    calls = []
    plan = calibrate_cpu_kernels([make_linear(torch.randn(64, 32))], repeats=1, others_clock=lambda: calls.append(1))
    assert len(calls) == 1 and isinstance(plan, KernelPlan)


def test_a_plan_names_known_kernels_for_each_flat_row_count():
    for bad in [("matvec",), ("matvec", "flat", "fast")]:
        with pytest.raises(ValueError, match="CPU kernel plan"):
            KernelPlan(bad)


def test_tandem_cpu_kernels_fixes_the_plan_instead_of_measuring(monkeypatch):
    """The variable is read by the command line (--cpu-kernels' fallback) and reaches the
    services' configs as a plan; the model then runs it instead of timing its own."""
    from tandem.cli import build_parser, draft_config, target_config

    linears = [make_linear(torch.randn(64, 32))]
    monkeypatch.setenv("TANDEM_CPU_KERNELS", "flat, blocked,blocked")
    target = target_config(build_parser().parse_args(["target"]), Path("/m"))
    draft = draft_config(build_parser().parse_args(["draft", "--draft-model", "/h"]), Path("/m"))
    assert target.cpu_kernels == draft.cpu_kernels == KernelPlan(("flat", "blocked", "blocked"))
    assert choose_kernels(target.cpu_kernels, "cpu", linears) == target.cpu_kernels
    assert plan_from_flag("") is None
    monkeypatch.setenv("TANDEM_CPU_KERNELS", "fast,flat,flat")
    with pytest.raises(InvalidArgument, match="TANDEM_CPU_KERNELS"):
        target_config(build_parser().parse_args(["target"]), Path("/m"))
