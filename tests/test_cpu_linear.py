"""Kernels: the C loop for linear layers of a few rows (triode.kernels.cpu_linear) against
torch.nn.functional.linear, the dispatch around it, and small float32 weights run on the
calling thread. Needs a C compiler; without one the
kernel cases are skipped and the dispatch falls back (tested in test_cpu_attention)."""

from __future__ import annotations

import pytest
import torch

from tests.linear_compare import SHAPES, assert_matches_linear, linear_inputs
from triode import kernels
from triode.kernels import cpu_linear
from triode.kernels.cpu_linear import (
    MAX_ROWS,
    ROWS_TAKEN,
    SERIAL_MAX_WEIGHTS,
    serial_linear_supports,
    small_linear_cpu,
    small_linear_supports,
)
from triode.kernels.native import native_library

needs_kernel = pytest.mark.skipif(native_library() is None, reason="no C compiler to build the kernels")


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", range(1, MAX_ROWS + 1))
@pytest.mark.parametrize(("features", "out", "with_bias"), SHAPES)
def test_matches_torch_linear(rows, features, out, with_bias, dtype):
    x, weight, bias = linear_inputs(rows, features, out, with_bias, dtype)
    result = small_linear_cpu(x, weight, bias)
    if rows > ROWS_TAKEN[dtype]:
        assert result is None  # torch's matmul is as fast there: the caller falls back to it
        return
    assert_matches_linear(result, x, weight, bias)


@needs_kernel
def test_rows_may_be_strided_views():
    """The rows of a decode batch are often a view of a wider tensor (e.g. attention output)."""
    wide = torch.randn(4, 2 * 64)
    x = wide[:, :64]
    weight = torch.randn(96, 64)
    torch.testing.assert_close(small_linear_cpu(x, weight), x @ weight.T, rtol=1e-5, atol=1e-5)


@needs_kernel
def test_dispatch_takes_the_loop_for_few_rows_only(monkeypatch):
    taken = []

    def recording(*args):
        out = small_linear_cpu(*args)
        if out is not None:
            taken.append(args[0].shape[0])
        return out

    monkeypatch.setattr(kernels, "small_linear_cpu", recording)
    weight = torch.randn(SERIAL_MAX_WEIGHTS // 16, 16)  # not small: see the test below
    for rows in (1, MAX_ROWS, MAX_ROWS + 1, 64):
        x = torch.randn(rows, 16)
        torch.testing.assert_close(kernels.linear(x, weight), x @ weight.T, rtol=1e-5, atol=1e-5)
    assert taken == [1, MAX_ROWS]
    kernels.set_backend("torch")
    try:
        kernels.linear(torch.randn(1, 16), weight)
    finally:
        kernels.set_backend("auto")
    assert taken == [1, MAX_ROWS]


def test_what_the_loop_does_not_take():
    weight = torch.randn(8, 16)
    assert small_linear_cpu(torch.randn(2, 17), weight) is None  # would read past each row
    assert not small_linear_supports(torch.randn(MAX_ROWS + 1, 16), weight, None)
    assert not small_linear_supports(torch.randn(4, 16, dtype=torch.bfloat16), weight.bfloat16(), None)
    assert not small_linear_supports(torch.randn(2, 16, dtype=torch.float64), weight.double(), None)
    assert not small_linear_supports(torch.randn(2, 16), weight.t().contiguous().t(), None)
    assert not small_linear_supports(torch.randn(16, 2).t(), weight, None)
    assert not small_linear_supports(torch.randn(2, 3, 16), weight, None)


@needs_kernel
def test_autograd_keeps_torch_linear():
    """Outside inference mode a parameter wants gradients: the dispatch leaves it to torch."""
    layer = torch.nn.Linear(16, 8)
    x = torch.randn(2, 16)
    assert not small_linear_supports(x, layer.weight, layer.bias)
    kernels.linear(x, layer.weight, layer.bias).sum().backward()
    assert layer.weight.grad is not None
    with torch.inference_mode():
        assert small_linear_supports(x, layer.weight, layer.bias)


def test_small_float32_weights_take_torch_on_the_calling_thread(monkeypatch):
    """A weight of a few thousand elements is microseconds of work: the dispatch gives it to
    torch's matmul with MKL held to the calling thread, at every row count, and puts MKL's
    per-thread setting back."""
    taken = []

    def recording(x, weight, bias=None):
        taken.append(x.shape[0])
        return cpu_linear.serial_linear(x, weight, bias)

    monkeypatch.setattr(kernels, "serial_linear", recording)
    weight, bias = torch.randn(128, 64), torch.randn(128)
    set_local = cpu_linear._mkl_threads_of_this_thread()
    available = set_local is not None
    if available:  # this thread's setting as the test found it (torch.set_num_threads sets it too)
        before = set_local(0)
        set_local(before)
    assert serial_linear_supports(torch.randn(4, 64), weight) == available
    assert not serial_linear_supports(torch.randn(4, 256), torch.randn(256, 256))
    assert not serial_linear_supports(torch.randn(4, 64).bfloat16(), weight.bfloat16())
    for rows in (1, MAX_ROWS, 64, 256):
        x = torch.randn(rows, 64)
        torch.testing.assert_close(kernels.linear(x, weight, bias), torch.nn.functional.linear(x, weight, bias))
    assert taken == ([1, MAX_ROWS, 64, 256] if available else [])
    if available:
        assert set_local(before) == before  # the per-thread setting put back
