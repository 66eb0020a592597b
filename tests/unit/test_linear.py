"""Every row count takes a kernel (matrix-vector, F.linear, oneDNN's blocked copy); all of them
compute nn.Linear's product."""

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from tandem.models.linear import MAX_FLAT_ROWS, make_linear


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
