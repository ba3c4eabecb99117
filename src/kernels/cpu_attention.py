"""Decode attention for CPUs that reads the paged KV cache in place (``csrc/paged_decode.h``).

The torch reference gathers every sequence's blocks into a padded copy before its fused
attention call; on a CPU that copy and the padded math were half of a large decode step. This
kernel walks each sequence's block table instead, one sequence (or two consecutive rows of
one prompt, computed together) per OpenMP task. It is built and loaded by
:mod:`triode.kernels.native`; without it decode attention takes the torch reference.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from triode.kernels.native import bind, cpu_isa

_ENTRY_POINTS = {torch.float32: "triode_paged_decode_f32", torch.bfloat16: "triode_paged_decode_bf16"}
MAX_HEADS, MAX_HEAD_DIM, MAX_BLOCK_SIZE = 64, 256, 64  # as in the C source
HEAD_DIM_MULTIPLE = 16  # the kernel's vectors are 16 floats

__all__ = ["cpu_decode_available", "cpu_decode_supports", "paged_decode_cpu"]


def _entry(dtype: torch.dtype):
    return _bound(dtype, cpu_isa())


@functools.cache
def _bound(dtype: torch.dtype, isa: str):
    pointer, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    return bind(_ENTRY_POINTS[dtype], pointer, i64, pointer, pointer, pointer, i64, pointer, pointer,
                i64, i32, i32, i32, i32, i32, ctypes.c_float, i32, ctypes.c_float)


def cpu_decode_available() -> bool:
    """Whether the kernel is built and loaded (builds it on the first call)."""
    return _entry(torch.float32) is not None


def cpu_decode_supports(query: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether these tensors fit the kernel: CPU, float32 or bfloat16 (query and cache alike),
    heads, head dim (a multiple of 16) and block size within the C source's limits, row
    layouts it can stride over, and no autograd to record (the kernel is invisible to it)."""
    _, block_size, kv_heads, head_dim = k_cache.shape
    return (
        query.device.type == "cpu"
        and query.dtype in _ENTRY_POINTS
        and k_cache.dtype == query.dtype
        and not (torch.is_grad_enabled() and query.requires_grad)
        and head_dim <= MAX_HEAD_DIM
        and head_dim % HEAD_DIM_MULTIPLE == 0
        and block_size <= MAX_BLOCK_SIZE
        and query.shape[1] <= MAX_HEADS
        and query.shape[1] % kv_heads == 0
        and query.stride(2) == 1
        and query.stride(1) == head_dim
        and _entry(query.dtype) is not None
    )


def paged_decode_cpu(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    *,
    window: int | None = None,
    softcap: float | None = None,
) -> None:
    """Writes into ``out`` [seqs, heads, dim] the attention of query [seqs, heads, dim] (one
    token per sequence) over each sequence's ``seq_lens[i]`` cached tokens (its last ``window``
    of them with a sliding window; scores soft-capped at ``softcap``). The caller checks the
    metadata (block ids within the cache, lengths within each table): the kernel trusts it."""
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, kv_heads, _ = k_cache.shape
    if not (k_cache.is_contiguous() and v_cache.is_contiguous() and block_tables.is_contiguous()
            and seq_lens.is_contiguous() and out.stride(2) == 1 and out.stride(1) == head_dim):
        raise ValueError("paged_decode_cpu: caches, block tables, seq_lens and out rows must be contiguous")
    if not (v_cache.dtype == out.dtype == k_cache.dtype == query.dtype
            and block_tables.dtype == seq_lens.dtype == torch.int32
            and out.shape == query.shape and seq_lens.shape == (num_seqs,)
            and k_cache.shape[3] == head_dim and v_cache.shape == k_cache.shape
            and block_tables.shape[0] >= num_seqs):
        raise ValueError("paged_decode_cpu: query, caches and out must share a dtype and head dim, "
                         "block tables and seq_lens must be int32, with a row and a length per sequence")
    status = _entry(query.dtype)(
        query.data_ptr(), query.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
        block_tables.data_ptr(), block_tables.stride(0), seq_lens.data_ptr(), out.data_ptr(),
        out.stride(0), num_seqs, num_heads, kv_heads, head_dim, block_size, scale, window or 0, softcap or 0.0,
    )
    if status:
        raise ValueError(f"paged_decode_cpu: unsupported shape (heads {num_heads}, kv heads {kv_heads}, "
                         f"dim {head_dim}, block size {block_size})")
