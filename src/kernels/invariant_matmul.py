"""A batch-invariant linear layer in Triton: ``x @ weight.T + bias`` where every output element
is summed in one order whatever the number of rows.

cuBLAS picks its tile, its split of the inner dimension and its kernel from the whole problem's
shape, so a row's sum changes order with the batch. Here the tile is fixed (BLOCK_M x BLOCK_N,
stepping BLOCK_K along the inner dimension from 0, one program per tile, no split), so a row's
result is the same chain of tile dots whichever tile and place in it the row lands in. It runs
for linear layers under ``--batch-invariant`` on CUDA (the default there stays cuBLAS, which is
faster); the tests run it under triton's interpreter.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from triode.kernels._jit import cdiv, lazy_jit
from triode.kernels.checks import check_launch_device, check_tensor

if TYPE_CHECKING:
    import triton.language as tl

__all__ = ["invariant_linear_triton"]

BLOCK_M, BLOCK_N, BLOCK_K = 32, 64, 32


@lazy_jit
def _invariant_linear_kernel(
    out_ptr,
    x_ptr,
    w_ptr,
    bias_ptr,
    rows,
    n,
    k,
    stride_x,
    stride_w,
    stride_out,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    offs_m = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < rows
    n_mask = offs_n < n
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, k, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < k
        a = tl.load(x_ptr + offs_m[:, None] * stride_x + offs_k[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptr + offs_n[None, :] * stride_w + offs_k[:, None],
                    mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc += tl.dot(a, w, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + offs_m[:, None] * stride_out + offs_n[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def invariant_linear_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [rows, in] @ weight[out, in].T (+ bias [out]) in x's dtype, float32 sums; weight and
    bias contiguous, on x's device."""
    check_launch_device("x", x)
    check_tensor("weight", weight, ndim=2, dtype=x.dtype, device=x.device, contiguous=True)
    if x.dim() != 2 or x.shape[1] != weight.shape[1] or x.stride(1) != 1:
        raise ValueError(f"x: expected [rows, {weight.shape[1]}] with contiguous rows, got "
                         f"{list(x.shape)} strides {x.stride()}")
    out_features = weight.shape[0]
    if bias is not None:
        check_tensor("bias", bias, shape=(out_features,), dtype=x.dtype, device=x.device, contiguous=True)
    out = torch.empty((x.shape[0], out_features), dtype=x.dtype, device=x.device)
    if x.shape[0] == 0:
        return out
    _invariant_linear_kernel[(cdiv(x.shape[0], BLOCK_M), cdiv(out_features, BLOCK_N))](
        out, x, weight, bias if bias is not None else weight, x.shape[0], out_features, x.shape[1],
        x.stride(0), weight.stride(0), out.stride(0), HAS_BIAS=bias is not None,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
        DOT_PRECISION="ieee",
    )
    return out
