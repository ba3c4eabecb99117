"""Linear layers of a few rows on CPUs (``csrc/small_linear.c``).

A decode step of one to eight sequences multiplies each weight matrix by that many rows: the
step is a pass over all the weights, and its speed is the memory bandwidth the matmul
reaches. torch's CPU matmul reaches about a third of it at these shapes (one to three rows
are its slowest), the C loop most of it. Where the model has packed its weights for oneDNN
(:mod:`triode.kernels.packed_linear`), the dispatch gives the loop one row only: oneDNN is faster
from two rows. Without packed weights the loop takes up to :data:`ROWS_TAKEN` rows, and torch
the rest (in bfloat16 the loop's conversions cost more than the memory it saves beyond three
rows).

Small float32 weights (fewer than :data:`SERIAL_MAX_WEIGHTS` elements) are a few microseconds
of work at any step's rows, yet MKL, which runs torch's float32 matmul, still splits them across
its threads, and waking a sleeping OpenMP thread costs tens of microseconds on these VMs (the
worker lets its threads sleep soon: triode.engine.actors.workers). :func:`serial_linear` runs them on
the calling thread, with torch's matmul (2.7 us at one row of a 64 x 128 weight, where the C loop
takes 9). On a 2-layer hidden-64 model that was 9 wake-ups a step.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from triode.kernels.native import bind, cpu_isa

_ENTRY_POINTS = {torch.float32: "triode_small_linear_f32", torch.bfloat16: "triode_small_linear_bf16"}
_INVARIANT_ENTRY_POINTS = {torch.float32: "triode_invariant_linear_f32", torch.bfloat16: "triode_invariant_linear_bf16"}
MAX_ROWS = 8  # as in the C source
# Rows the dispatch gives the loop, per dtype. Decode steps of the default model on this
# 2-core CPU (ms, torch -> loop): float32 1 row 60 -> 21, 8 rows 91 -> 67; bfloat16 1 row
# 37 -> 16, 4 rows 38 -> 37, 8 rows 43 -> 51.
ROWS_TAKEN = {torch.float32: MAX_ROWS, torch.bfloat16: 3}
SERIAL_MAX_WEIGHTS = 1 << 16  # as PARALLEL_MIN_WEIGHTS in the C sources

__all__ = ["MAX_ROWS", "ROWS_TAKEN", "SERIAL_MAX_WEIGHTS", "invariant_linear_cpu", "serial_linear",
           "serial_linear_supports", "small_linear_cpu", "small_linear_supports"]


def _entry(dtype: torch.dtype):
    return _bound(dtype, cpu_isa())


@functools.cache
def _bound(dtype: torch.dtype, isa: str):
    pointer, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    return bind(_ENTRY_POINTS[dtype], pointer, i64, pointer, pointer, pointer, i64, i32, i32, i64)


@functools.cache
def _invariant_entry(dtype: torch.dtype, isa: str):
    pointer, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    return bind(_INVARIANT_ENTRY_POINTS[dtype], pointer, i64, pointer, pointer, pointer, i64, i64, i32, i64)


def small_linear_supports(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether the C loop takes ``linear(x, weight, bias)``: CPU, float32 or bfloat16 rows (1 to
    ``ROWS_TAKEN[dtype]``) with unit column stride, a contiguous weight and bias of that dtype,
    and no autograd to record (the loop is invisible to it: the model runs in inference mode)."""
    return x.dim() == 2 and x.dtype in ROWS_TAKEN and 1 <= x.shape[0] <= ROWS_TAKEN[x.dtype] and _takes(x, weight, bias)


def _takes(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    return (
        x.device.type == "cpu"
        and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
        and x.dim() == 2
        and x.dtype in ROWS_TAKEN
        and x.stride(1) == 1
        and weight.dtype == x.dtype
        and weight.dim() == 2
        and weight.shape[1] == x.shape[1]
        and weight.is_contiguous()
        and (bias is None or (bias.dtype == x.dtype and bias.is_contiguous() and bias.shape == weight.shape[:1]))
        and _entry(x.dtype) is not None
    )


def small_linear_cpu(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor | None:
    """``x @ weight.T + bias`` as a new [rows, out] tensor, or None when the loop does not take
    these tensors (:func:`small_linear_supports`), so that the caller uses torch."""
    if not small_linear_supports(x, weight, bias):
        return None
    rows, features = x.shape
    out = torch.empty((rows, weight.shape[0]), dtype=x.dtype)
    status = _entry(x.dtype)(
        x.data_ptr(), x.stride(0), weight.data_ptr(), None if bias is None else bias.data_ptr(),
        out.data_ptr(), out.stride(0), rows, features, weight.shape[0],
    )
    if status:
        raise ValueError(f"small_linear_cpu: {rows} rows; the loop takes 1..{MAX_ROWS}")
    return out


def invariant_linear_cpu(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor | None:
    """``x @ weight.T + bias`` for any number of rows, each row's result independent of the
    others (``triode_invariant_linear_*``: the loop's tiles at every row count), or None when
    the loop does not take these tensors."""
    if not (_takes(x, weight, bias) and (entry := _invariant_entry(x.dtype, cpu_isa())) is not None):
        return None
    rows, features = x.shape
    out = torch.empty((rows, weight.shape[0]), dtype=x.dtype)
    if rows:
        entry(x.data_ptr(), x.stride(0), weight.data_ptr(), None if bias is None else bias.data_ptr(),
              out.data_ptr(), out.stride(0), rows, features, weight.shape[0])
    return out


@functools.cache
def _mkl_threads_of_this_thread():
    """MKL's ``mkl_set_num_threads_local`` (C interface) from the torch build that links MKL
    in, or None (another BLAS: its matmul then runs as torch runs it)."""
    try:
        setter = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so")).MKL_Set_Num_Threads_Local
    except (OSError, AttributeError):
        return None
    setter.argtypes, setter.restype = [ctypes.c_int], ctypes.c_int
    return setter


def serial_linear_supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`serial_linear` takes ``linear(x, weight)``: float32 on a CPU, a weight of
    fewer than :data:`SERIAL_MAX_WEIGHTS` elements, and MKL under torch's matmul."""
    return (x.device.type == "cpu" and x.dtype == torch.float32 and weight.numel() < SERIAL_MAX_WEIGHTS
            and _mkl_threads_of_this_thread() is not None)


def serial_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` by torch's matmul, with MKL told to use the calling thread only
    for this call (a per-thread setting, put back after)."""
    set_threads = _mkl_threads_of_this_thread()
    previous = set_threads(1)
    try:
        return torch.nn.functional.linear(x, weight, bias)
    finally:
        set_threads(previous)
