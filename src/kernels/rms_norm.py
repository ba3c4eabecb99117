"""RMSNorm with the optional fused residual add.

The torch reference reproduces Hugging Face's arithmetic (float32 statistics, cast back to the
input dtype before the weight multiply) so greedy outputs stay identical; the Triton kernel does
the same roundings in the same places. One program per row; rows may be a strided 2-D or 3-D
view (Qwen3's per-head q/k norm runs on [tokens, heads, head_dim] slices of the qkv output).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from triode.kernels._jit import lazy_jit, next_power_of_2
from triode.kernels.checks import check_launch_device, check_tensor

if TYPE_CHECKING:
    import triton.language as tl

__all__ = ["rms_norm_reference", "rms_norm_triton"]

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def rms_norm_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Returns (normed, new_residual); with ``residual`` the input is ``x + residual`` and
    that sum is also returned as the next residual."""
    if residual is not None:
        x = x + residual
        residual = x
    hidden = x.float()
    variance = hidden.pow(2).mean(-1, keepdim=True)
    hidden = hidden * torch.rsqrt(variance + eps)
    return weight * hidden.to(x.dtype), residual


@lazy_jit
def _rms_norm_kernel(
    out_ptr,
    residual_out_ptr,
    x_ptr,
    residual_ptr,
    weight_ptr,
    inner,
    hidden,
    stride_xa,
    stride_xb,
    stride_ra,
    stride_rb,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    a = row // inner
    b = row % inner
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    x = tl.load(x_ptr + a * stride_xa + b * stride_xb + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + a * stride_ra + b * stride_rb + offs, mask=mask, other=0.0)
        # torch adds in the input dtype: round the float32 sum back before using it
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * hidden + offs, x, mask=mask)
    xf = x.to(tl.float32)
    variance = tl.sum(xf * xf, axis=0) / hidden
    rstd = 1.0 / tl.sqrt(variance + eps)
    normed = (xf * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * hidden + offs, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)


def _rows_view(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """[A, B, hidden] view of a tensor with 2 or more dimensions (B = 1 for 2-D)."""
    if tensor.ndim == 2:
        return tensor.unsqueeze(1)
    if tensor.ndim == 3:
        return tensor
    try:
        return tensor.view(-1, *tensor.shape[-2:])
    except RuntimeError as error:
        raise ValueError(f"{name}: its leading dimensions cannot be flattened without a copy "
                         f"(shape {list(tensor.shape)}, strides {tensor.stride()})") from error


def rms_norm_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Same contract as :func:`rms_norm_reference`. ``x`` [..., hidden] (at least 2-D, last
    dimension contiguous, any other strides); outputs are new contiguous tensors."""
    check_tensor("x", x, dtype=FLOAT_DTYPES)
    if x.ndim < 2:
        raise ValueError(f"x: expected at least 2 dimensions [..., hidden], got shape {list(x.shape)}")
    check_launch_device("x", x)
    hidden = x.shape[-1]
    check_tensor("weight", weight, shape=(hidden,), dtype=FLOAT_DTYPES, device=x.device, contiguous=True)
    if residual is not None:
        check_tensor("residual", residual, shape=x.shape, dtype=x.dtype, device=x.device)
    if not isinstance(eps, (int, float)) or not eps >= 0:
        raise ValueError(f"eps: expected a non-negative float, got {eps!r}")
    x3 = _rows_view("x", x)
    r3 = _rows_view("residual", residual) if residual is not None else x3
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    new_residual = torch.empty_like(x, memory_format=torch.contiguous_format) if residual is not None else None
    rows = x3.shape[0] * x3.shape[1]
    if rows and hidden:
        block = next_power_of_2(hidden)
        _rms_norm_kernel[(rows,)](
            out, new_residual if new_residual is not None else out, x3, r3, weight,
            x3.shape[1], hidden, x3.stride(0), x3.stride(1), r3.stride(0), r3.stride(1), float(eps),
            HAS_RESIDUAL=residual is not None, BLOCK=block,
            num_warps=min(16, max(1, block // 512)),
        )
    return out, new_residual
