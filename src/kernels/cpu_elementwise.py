"""RMSNorm, SiLU-and-multiply, rotary embedding and the KV cache write for CPUs
(``csrc/elementwise.c``).

Each torch reference is 2 to 20 ops with a temporary apiece; a decode step of the default
model calls these 150 times, and at decode sizes a call is mostly dispatch (on this 2-core CPU
0.1-0.2 ms each: 19 of a 64-sequence step's 158 ms, 6 once in C). The C versions are one pass
over the rows. Each function here returns None (rotary, KV write: False) when its tensors do
not fit the C source, so that the caller runs the reference: CPU, float32 or bfloat16, row
layouts the source can stride over, and no autograd to record.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from triode.kernels.native import bind, cpu_isa

_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}
_POINTER, _I64, _I32, _FLOAT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
_SIGNATURES = {
    "rms_norm": (_POINTER, _I64, _POINTER, _I64, _POINTER, _POINTER, _POINTER, _I64, _I32, _FLOAT),
    "silu_mul": (_POINTER, _I64, _POINTER, _I64, _I32),
    "rotary": (_POINTER, _I64, _POINTER, _I64, _I32, _POINTER, _I64, _I32, _POINTER, _I64, _I32),
    "write_kv": (_POINTER, _I64, _POINTER, _I64, _POINTER, _POINTER, _POINTER, _I64, _I64, _I32),
}

__all__ = ["rms_norm_cpu", "rotary_embedding_cpu", "silu_and_mul_cpu", "write_kv_cpu"]


def _entry(op: str, dtype: torch.dtype):
    return _bound(op, dtype, cpu_isa())


@functools.cache
def _bound(op: str, dtype: torch.dtype, isa: str):
    return bind(f"triode_{op}_{_SUFFIX[dtype]}", *_SIGNATURES[op])


def _on_cpu(*tensors: torch.Tensor) -> bool:
    return all(t.device.type == "cpu" for t in tensors)


def _takes(op: str, x: torch.Tensor) -> bool:
    """Whether ``op``'s C function is built and takes rows like x (the checks every op shares)."""
    return (
        x.device.type == "cpu"
        and x.dtype in _SUFFIX
        and not (torch.is_grad_enabled() and x.requires_grad)
        and x.stride(-1) == 1
        and _entry(op, x.dtype) is not None
    )


def rms_norm_cpu(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """:func:`triode.kernels.rms_norm.rms_norm_reference` for 2-D rows, or None."""
    if not (
        _takes("rms_norm", x) and x.dim() == 2 and _on_cpu(weight) and weight.dtype == x.dtype
        and weight.is_contiguous() and weight.shape == x.shape[1:]
        and not (torch.is_grad_enabled() and weight.requires_grad)
        and (residual is None or (_on_cpu(residual) and residual.dtype == x.dtype
                                  and residual.shape == x.shape and residual.stride(1) == 1))
    ):
        return None
    rows, hidden = x.shape
    out = torch.empty((rows, hidden), dtype=x.dtype)
    new_residual = torch.empty_like(out) if residual is not None else None
    _entry("rms_norm", x.dtype)(
        x.data_ptr(), x.stride(0), None if residual is None else residual.data_ptr(),
        0 if residual is None else residual.stride(0), weight.data_ptr(), out.data_ptr(),
        None if new_residual is None else new_residual.data_ptr(), rows, hidden, eps,
    )
    return out, new_residual


def silu_and_mul_cpu(x: torch.Tensor) -> torch.Tensor | None:
    """:func:`triode.kernels.silu_mul.silu_and_mul_reference` for 2-D rows, or None."""
    if not (_takes("silu_mul", x) and x.dim() == 2 and x.shape[1] % 2 == 0):
        return None
    rows, d = x.shape[0], x.shape[1] // 2
    out = torch.empty((rows, d), dtype=x.dtype)
    _entry("silu_mul", x.dtype)(x.data_ptr(), x.stride(0), out.data_ptr(), rows, d)
    return out


def rotary_embedding_cpu(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor
) -> bool:
    """:func:`triode.kernels.rotary.rotary_embedding_reference` (in place), or False without touching
    anything. Positions outside the cache raise ValueError before anything is rotated, as the
    reference's lookup does."""
    dim = query.shape[-1]
    if not (
        _takes("rotary", query) and _on_cpu(key, positions, cos_sin_cache)
        and query.dim() == key.dim() == 3 and key.dtype == query.dtype
        and key.shape[-1] == dim and dim % 2 == 0 and query.stride(1) == key.stride(1) == dim
        and key.stride(2) == 1 and key.shape[0] == query.shape[0] == positions.shape[0]
        and positions.dtype == torch.int64 and positions.is_contiguous() and positions.dim() == 1
        and cos_sin_cache.dtype == torch.float32 and cos_sin_cache.is_contiguous()
        and cos_sin_cache.dim() == 2 and cos_sin_cache.shape[1] == dim
    ):
        return False
    status = _entry("rotary", query.dtype)(
        positions.data_ptr(), positions.shape[0], query.data_ptr(), query.stride(0), query.shape[1],
        key.data_ptr(), key.stride(0), key.shape[1], cos_sin_cache.data_ptr(), cos_sin_cache.shape[0], dim,
    )
    if status:
        raise ValueError(
            f"rotary_embedding: a position outside the cache's {cos_sin_cache.shape[0]} positions"
        )
    return True


def write_kv_cpu(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> bool:
    """:func:`triode.kernels.kv_write.write_kv_reference`, or False without touching anything. A slot
    outside the caches raises ValueError (nothing written), as the reference's copy does."""
    if not (
        _takes("write_kv", key) and _on_cpu(value, k_cache, v_cache, slot_mapping)
        and key.dim() == value.dim() == 3 and k_cache.dim() == 4
        and key.dtype == value.dtype == k_cache.dtype == v_cache.dtype
        and key.shape == value.shape and key.shape[1:] == k_cache.shape[2:] == v_cache.shape[2:]
        and key.stride(1) == value.stride(1) == key.shape[2] and value.stride(2) == 1
        and k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape == v_cache.shape
        and slot_mapping.dtype == torch.int64 and slot_mapping.is_contiguous()
        and slot_mapping.shape == key.shape[:1]
    ):
        return False
    slots = k_cache.shape[0] * k_cache.shape[1]
    status = _entry("write_kv", key.dtype)(
        key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0), k_cache.data_ptr(),
        v_cache.data_ptr(), slot_mapping.data_ptr(), key.shape[0], slots, key.shape[1] * key.shape[2],
    )
    if status:
        raise ValueError(f"write_kv: a slot outside the caches' {slots} slots")
    return True
