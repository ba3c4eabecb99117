"""Rotary position embedding, neox style (rotate the two halves of each head), in place.

``cos_sin_cache`` [max_positions, head_dim] holds cos in its first half and sin in its second;
the rope variants the models use (plain, Llama 3 scaling, ...) differ only in how that cache is
built, not here. The Triton kernel rounds where the torch reference does (cos/sin cast to the
query dtype, every product and sum rounded back). Under the interpreter bfloat16 results are
within one ulp of the reference; on an H200 23% of elements differed from it, and the
kernel's were the closer to float32 (scripts/gpu_check.py, docs/benchmarks.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from triode.kernels._jit import lazy_jit, next_power_of_2
from triode.kernels.checks import check_launch_device, check_tensor

if TYPE_CHECKING:
    import triton.language as tl

__all__ = ["rotary_embedding_reference", "rotary_embedding_triton"]

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def rotary_embedding_reference(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
) -> None:
    """query [tokens, heads, dim], key [tokens, kv_heads, dim] rotated in place;
    cos_sin_cache [max_positions, dim]: cos in the first half, sin in the second."""
    half = cos_sin_cache.shape[1] // 2
    cos_sin = cos_sin_cache.index_select(0, positions)
    cos = cos_sin[:, None, :half].to(query.dtype)
    sin = cos_sin[:, None, half:].to(query.dtype)
    for tensor in (query, key):
        x1, x2 = tensor[..., :half], tensor[..., half:]
        rotated_1 = x1 * cos - x2 * sin
        rotated_2 = x2 * cos + x1 * sin
        tensor[..., :half] = rotated_1
        tensor[..., half:] = rotated_2


@lazy_jit
def _rotary_kernel(
    positions_ptr,
    query_ptr,
    key_ptr,
    cos_sin_ptr,
    max_positions,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cos,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token).to(tl.int64)
    dtype = query_ptr.dtype.element_ty
    offs_d = tl.arange(0, BLOCK_HALF)
    d_mask = offs_d < HALF
    # a position past the cache is a caller bug the kernel cannot report: never read past it
    position = tl.minimum(tl.maximum(position, 0), max_positions - 1)
    cos = tl.load(cos_sin_ptr + position * stride_cos + offs_d, mask=d_mask, other=0.0)
    sin = tl.load(cos_sin_ptr + position * stride_cos + HALF + offs_d, mask=d_mask, other=0.0)
    cos = cos.to(dtype).to(tl.float32)[None, :]
    sin = sin.to(dtype).to(tl.float32)[None, :]

    offs_h = tl.arange(0, BLOCK_HQ)
    mask = (offs_h < NUM_HEADS)[:, None] & d_mask[None, :]
    first = query_ptr + token * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :]
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    r1 = (x1 * cos).to(dtype).to(tl.float32) - (x2 * sin).to(dtype).to(tl.float32)
    r2 = (x2 * cos).to(dtype).to(tl.float32) + (x1 * sin).to(dtype).to(tl.float32)
    tl.store(first, r1.to(dtype), mask=mask)
    tl.store(first + HALF, r2.to(dtype), mask=mask)

    offs_h = tl.arange(0, BLOCK_HK)
    mask = (offs_h < NUM_KV_HEADS)[:, None] & d_mask[None, :]
    first = key_ptr + token * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :]
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    r1 = (x1 * cos).to(dtype).to(tl.float32) - (x2 * sin).to(dtype).to(tl.float32)
    r2 = (x2 * cos).to(dtype).to(tl.float32) + (x1 * sin).to(dtype).to(tl.float32)
    tl.store(first, r1.to(dtype), mask=mask)
    tl.store(first + HALF, r2.to(dtype), mask=mask)


def rotary_embedding_triton(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
) -> None:
    """Same contract as :func:`rotary_embedding_reference`. query/key may be strided views of a
    fused qkv output (last dimension contiguous); positions int32 or int64."""
    check_tensor("query", query, ndim=3, dtype=FLOAT_DTYPES)
    check_launch_device("query", query)
    num_tokens, num_heads, head_dim = query.shape
    device = query.device
    check_tensor("key", key, ndim=3, dtype=query.dtype, device=device)
    if key.shape[0] != num_tokens or key.shape[2] != head_dim:
        raise ValueError(f"key: expected [{num_tokens}, kv_heads, {head_dim}], got {list(key.shape)}")
    check_tensor("positions", positions, shape=(num_tokens,), dtype=(torch.int64, torch.int32),
                 device=device, contiguous=True)
    check_tensor("cos_sin_cache", cos_sin_cache, ndim=2, dtype=FLOAT_DTYPES, device=device)
    if cos_sin_cache.shape[1] != head_dim or head_dim % 2:
        raise ValueError(f"cos_sin_cache: expected [max_positions, {head_dim}] (an even head_dim), "
                         f"got {list(cos_sin_cache.shape)}")
    if num_tokens == 0:
        return
    half = head_dim // 2
    _rotary_kernel[(num_tokens,)](
        positions, query, key, cos_sin_cache, cos_sin_cache.shape[0],
        query.stride(0), query.stride(1), key.stride(0), key.stride(1), cos_sin_cache.stride(0),
        NUM_HEADS=num_heads, NUM_KV_HEADS=key.shape[1], HALF=half,
        BLOCK_HQ=next_power_of_2(num_heads), BLOCK_HK=next_power_of_2(key.shape[1]),
        BLOCK_HALF=next_power_of_2(half), num_warps=4 if num_heads * half >= 1024 else 1,
    )
