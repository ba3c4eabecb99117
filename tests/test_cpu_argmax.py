"""Kernels: the C row-wise argmax (triode.kernels.cpu_argmax) against torch's ``argmax(dim=-1)``:
the first maximum, the first NaN, ties, -inf rows, strided rows; with this CPU's build and the
AVX2 one (`isa`). Needs a C compiler; without one the dispatch runs torch's."""

from __future__ import annotations

import pytest
import torch

from triode import kernels
from triode.kernels.cpu_argmax import argmax_cpu
from triode.kernels.native import native_library

needs_kernel = pytest.mark.skipif(native_library() is None, reason="no C compiler to build the kernels")


def _assert_as_torch(x: torch.Tensor) -> None:
    result = argmax_cpu(x)
    assert result is not None and result.dtype == torch.int64
    assert torch.equal(result, x.argmax(dim=-1)), (result, x.argmax(dim=-1))


@needs_kernel
@pytest.mark.parametrize(("rows", "cols"), [
    (rows, cols) for rows in (1, 3, 64, 300) for cols in (1, 7, 16, 17, 384, 1000, 49159) if rows * cols < 4_000_000
])
def test_matches_torch_on_random_rows(rows, cols, isa):
    generator = torch.Generator().manual_seed(rows * cols)
    _assert_as_torch(torch.randn(rows, cols, generator=generator))


@needs_kernel
def test_ties_give_the_first_maximum(isa):
    x = torch.zeros(6, 100)
    x[1, [5, 21, 37]] = 3.0  # the same maximum in several vector lanes and positions
    x[2, [40, 8]] = 2.0
    x[3, [99, 98]] = 1.0  # in the scalar tail only
    x[4, [3, 19]] = 1.0  # lane 3 of two vectors
    x[5] = float("-inf")  # every token banned: index 0, as torch
    _assert_as_torch(x)
    _assert_as_torch(torch.ones(3, 33))


@needs_kernel
def test_a_nan_wins_as_in_torch(isa):
    x = torch.randn(5, 70)
    x[0, 40] = float("nan")
    x[1, 3] = x[1, 60] = float("nan")
    x[2, 69] = float("nan")  # in the tail
    x[3, 0] = float("nan")
    _assert_as_torch(x)


@needs_kernel
def test_strided_rows_and_what_is_not_taken():
    wide = torch.randn(8, 300)
    _assert_as_torch(wide[:, :250])
    _assert_as_torch(wide[::2])
    assert argmax_cpu(torch.randn(4, 10).t()) is None  # columns not contiguous
    assert argmax_cpu(torch.randn(4, 10, dtype=torch.float64)) is None
    assert argmax_cpu(torch.randn(10)) is None
    assert argmax_cpu(torch.randn(4, 0)) is None
    x = torch.randn(4, 10, dtype=torch.float64)
    assert torch.equal(kernels.argmax(x), x.argmax(dim=-1))
    assert argmax_cpu(torch.empty(0, 10)).shape == (0,)
