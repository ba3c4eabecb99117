"""SiLU-and-multiply: ``silu(gate) * up`` for the MLP's fused gate/up projection output; and
its GELU twin (Gemma's tanh-approximated GELU), which runs as torch's own op on every device.

The Triton kernel rounds where torch does (silu's result is cast to the input dtype before the
multiply), so it matches the reference bit for bit up to float32 transcendental differences.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from triode.kernels._jit import cdiv, lazy_jit, next_power_of_2
from triode.kernels.checks import check_launch_device, check_tensor

if TYPE_CHECKING:
    import triton.language as tl

__all__ = ["gelu_tanh_and_mul", "silu_and_mul_reference", "silu_and_mul_triton"]

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    """x [tokens, 2 * d] holds gate then up; returns silu(gate) * up, [tokens, d]."""
    half = x.shape[-1] // 2
    return F.silu(x[..., :half]) * x[..., half:]


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [tokens, 2 * d] holds gate then up; returns gelu_tanh(gate) * up, [tokens, d], as
    transformers' gelu_pytorch_tanh computes it."""
    half = x.shape[-1] // 2
    return F.gelu(x[..., :half], approximate="tanh") * x[..., half:]


@lazy_jit
def _silu_and_mul_kernel(
    out_ptr,
    x_ptr,
    stride_xt,
    d,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < d
    gate = tl.load(x_ptr + row * stride_xt + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_xt + d + offs, mask=mask, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * d + offs, (silu * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    """Same contract as :func:`silu_and_mul_reference`; x [..., 2 * d] with a contiguous last
    dimension (a 2-D x may have any row stride); returns a new contiguous [..., d]."""
    check_tensor("x", x, dtype=FLOAT_DTYPES)
    if x.ndim < 1 or x.shape[-1] % 2:
        raise ValueError(f"x: expected [..., 2 * d], got shape {list(x.shape)}")
    check_launch_device("x", x)
    d = x.shape[-1] // 2
    if x.ndim == 2:
        rows = x
    else:
        try:
            rows = x.view(-1, 2 * d)
        except RuntimeError as error:
            raise ValueError(f"x: its leading dimensions cannot be flattened without a copy "
                             f"(shape {list(x.shape)}, strides {x.stride()})") from error
    out = torch.empty((*x.shape[:-1], d), dtype=x.dtype, device=x.device)
    if rows.shape[0] and d:
        block = min(1024, next_power_of_2(d))
        _silu_and_mul_kernel[(rows.shape[0], cdiv(d, block))](
            out, rows, rows.stride(0), d, BLOCK=block, num_warps=4 if block >= 512 else 1,
        )
    return out
