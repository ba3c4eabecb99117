"""KV write: scatter a step's keys and values into the paged cache by slot mapping.

Torch reference (the CPU path), Triton kernel and its launcher. One program per token copies all
of its kv heads for both caches; a negative slot (padding) or one past the cache is skipped.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from triode.kernels._jit import lazy_jit, next_power_of_2
from triode.kernels.checks import check_kv_cache, check_launch_device, check_tensor

if TYPE_CHECKING:
    import triton.language as tl

__all__ = ["check_write_kv_args", "write_kv_reference", "write_kv_triton"]


def write_kv_reference(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """key/value: [num_tokens, kv_heads, head_dim]; caches: [num_blocks, block_size, kv_heads,
    head_dim]; slot_mapping: [num_tokens] flat slot = block_id * block_size + offset."""
    num_blocks, block_size, kv_heads, head_dim = k_cache.shape
    flat_k = k_cache.view(num_blocks * block_size, kv_heads, head_dim)
    flat_v = v_cache.view(num_blocks * block_size, kv_heads, head_dim)
    flat_k.index_copy_(0, slot_mapping, key)
    flat_v.index_copy_(0, slot_mapping, value)


def check_write_kv_args(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    check_kv_cache(k_cache, v_cache)
    _, _, kv_heads, head_dim = k_cache.shape
    check_tensor("key", key, ndim=3, dtype=k_cache.dtype, device=k_cache.device)
    check_tensor("value", value, shape=key.shape, dtype=k_cache.dtype, device=k_cache.device)
    if key.shape[1:] != (kv_heads, head_dim):
        raise ValueError(f"key: expected [*, {kv_heads}, {head_dim}], got {list(key.shape)}")
    check_tensor("slot_mapping", slot_mapping, shape=(key.shape[0],), dtype=torch.int64,
                 device=k_cache.device, contiguous=True)


@lazy_jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    num_slots,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if (slot < 0) | (slot >= num_slots):
        return
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h < KV_HEADS)[:, None] & (offs_d < HEAD_DIM)[None, :]
    dst = slot * (KV_HEADS * HEAD_DIM) + offs_h[:, None] * HEAD_DIM + offs_d[None, :]
    k = tl.load(key_ptr + token * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    tl.store(k_cache_ptr + dst, k, mask=mask)
    v = tl.load(value_ptr + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


def write_kv_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Same contract as :func:`write_kv_reference`; key/value may be strided views (only their
    last dimension must be contiguous), the caches must be contiguous."""
    check_write_kv_args(key, value, k_cache, v_cache, slot_mapping)
    check_launch_device("key", key)
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    num_blocks, block_size, kv_heads, head_dim = k_cache.shape
    block_h, block_d = next_power_of_2(kv_heads), next_power_of_2(head_dim)
    _write_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping, num_blocks * block_size,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        KV_HEADS=kv_heads, HEAD_DIM=head_dim, BLOCK_H=block_h, BLOCK_D=block_d,
        num_warps=4 if block_h * block_d >= 2048 else 1,
    )
