"""Decode attention over the paged KV cache: one query token per sequence, GQA.

The Triton version is flash-decoding: the grid is (sequence, kv head, context partition); each
program loads its kv head's K/V tiles once for all the query heads of its group (a
[group, head_dim] x [head_dim, BLOCK_N] dot), runs an online softmax over its partition and
writes a partial result (max, exp-sum, normalised output); a reduction kernel combines the
partitions. With one partition (enough sequences to fill the GPU) the first kernel writes the
output directly and the reduction is skipped. Everything accumulates in float32.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from kernels._jit import cdiv, lazy_jit, next_power_of_2
from kernels.checks import check_kv_cache, check_launch_device, check_tensor

if TYPE_CHECKING:
    import triton.language as tl

__all__ = [
    "check_tiling",
    "choose_partition_size",
    "decode_attention_reference",
    "decode_attention_triton",
    "launch_decode",
]

LOG2E = 1.4426950408889634
# Programs the decode grid aims for per multiprocessor before it splits contexts further.
PROGRAMS_PER_SM = 8
MIN_PARTITION = 256
DEFAULT_BLOCK_N = 64


def decode_attention_reference(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    scale: float,
) -> torch.Tensor:
    """query [seqs, heads, dim], one token per sequence, attends to its ``seq_lens[i]`` cached
    tokens. Returns [seqs, heads, dim].

    The CPU hot path: every sequence's blocks are gathered once (padded to the longest), and
    one fused scaled_dot_product_attention call covers the batch. The query heads that share a
    KV head are passed as that head's query rows, so no KV head is repeated."""
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, kv_heads, _ = k_cache.shape
    num_blocks = -(-max_seq_len // block_size)
    length = num_blocks * block_size
    table = block_tables[:num_seqs, :num_blocks].reshape(-1)
    shape = (num_seqs, length, kv_heads, head_dim)
    keys = k_cache.index_select(0, table).view(shape).transpose(1, 2)
    values = v_cache.index_select(0, table).view(shape).transpose(1, 2)
    lengths = seq_lens[:num_seqs]
    mask = None
    if int(lengths.min()) < length:
        positions = torch.arange(length, device=query.device)
        mask = (positions[None, :] < lengths[:, None])[:, None, None, :]
    q = query.view(num_seqs, kv_heads, num_heads // kv_heads, head_dim)
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)
    return out.reshape(num_seqs, num_heads, head_dim)


@lazy_jit
def _decode_partition_kernel(
    out_ptr,
    part_out_ptr,
    part_max_ptr,
    part_sum_ptr,
    query_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    scale_log2e,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    partition_size,
    num_partitions,
    max_context,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    # never past the host's max_seq_len (checked against the block table's width)
    seq_len = tl.minimum(tl.load(seq_lens_ptr + seq), max_context)
    start = part * partition_size
    if SPLIT:
        if start >= seq_len:
            return  # the reduction reads only the partitions a sequence has
    end = tl.minimum(start + partition_size, seq_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    heads = kv_head * GROUP + offs_g
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    gd_mask = g_mask[:, None] & d_mask[None, :]
    q = tl.load(query_ptr + seq * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=gd_mask, other=0.0)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    table = block_tables_ptr + seq * stride_bt
    for n0 in range(start, end, BLOCK_N):
        tokens = n0 + offs_n
        n_mask = tokens < end
        blocks = tl.load(table + tokens // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        rows = blocks * stride_cb + (tokens % BLOCK_SIZE) * stride_cs + kv_head * stride_ch
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2e
        scores = tl.where(n_mask[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_cache_ptr + rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    l_safe = tl.where(l_i > 0, l_i, 1.0)
    result = acc / l_safe[:, None]
    if SPLIT:
        num_heads = tl.num_programs(1) * GROUP
        index = (seq * num_heads + heads) * num_partitions + part
        tl.store(part_max_ptr + index, m_i, mask=g_mask)
        tl.store(part_sum_ptr + index, l_i, mask=g_mask)
        tl.store(part_out_ptr + index[:, None] * HEAD_DIM + offs_d[None, :], result, mask=gd_mask)
    else:
        tl.store(out_ptr + seq * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
                 result.to(out_ptr.dtype.element_ty), mask=gd_mask)


@lazy_jit
def _decode_reduce_kernel(
    out_ptr,
    part_out_ptr,
    part_max_ptr,
    part_sum_ptr,
    seq_lens_ptr,
    stride_ot,
    stride_oh,
    partition_size,
    num_partitions,
    max_context,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    num_heads = tl.num_programs(1)
    seq_len = tl.minimum(tl.load(seq_lens_ptr + seq), max_context)
    used = tl.cdiv(seq_len, partition_size)
    base = (seq * num_heads + head) * num_partitions
    offs_p = tl.arange(0, BLOCK_P)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM

    m_vec = tl.full([BLOCK_P], float("-inf"), tl.float32)
    for p0 in range(0, used, BLOCK_P):
        p_mask = p0 + offs_p < used
        m = tl.load(part_max_ptr + base + p0 + offs_p, mask=p_mask, other=float("-inf"))
        m_vec = tl.maximum(m_vec, m)
    m_max = tl.max(m_vec, axis=0)

    total = tl.zeros([BLOCK_P], tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for p0 in range(0, used, BLOCK_P):
        p_mask = p0 + offs_p < used
        m = tl.load(part_max_ptr + base + p0 + offs_p, mask=p_mask, other=float("-inf"))
        sums = tl.load(part_sum_ptr + base + p0 + offs_p, mask=p_mask, other=0.0)
        w = tl.where(p_mask & (sums > 0), sums * tl.exp2(m - m_max), 0.0)
        o = tl.load(part_out_ptr + (base + p0 + offs_p)[:, None] * HEAD_DIM + offs_d[None, :],
                    mask=p_mask[:, None] & d_mask[None, :], other=0.0)
        total += w
        acc += tl.sum(o * w[:, None], axis=0)
    denominator = tl.sum(total, axis=0)
    result = acc / tl.where(denominator > 0, denominator, 1.0)
    tl.store(out_ptr + seq * stride_ot + head * stride_oh + offs_d,
             result.to(out_ptr.dtype.element_ty), mask=d_mask)


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1


def choose_partition_size(num_seqs: int, kv_heads: int, max_seq_len: int, block_n: int,
                          device: torch.device) -> int:
    """Split contexts only as far as needed to give the GPU enough programs: a big batch runs
    unsplit (no reduction), a few long sequences get partitions of >= MIN_PARTITION tokens."""
    wanted = PROGRAMS_PER_SM * _multiprocessors(device)
    partitions = max(1, min(cdiv(wanted, max(1, num_seqs * kv_heads)), cdiv(max_seq_len, MIN_PARTITION)))
    return max(block_n, cdiv(cdiv(max_seq_len, partitions), block_n) * block_n)


def _dot_precision(dtype: torch.dtype) -> str:
    # float32 inputs: full-precision dots (tf32 would miss the reference by ~1e-3)
    return "ieee" if dtype == torch.float32 else "tf32"


def decode_attention_triton(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    partition_size: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """Same contract as :func:`decode_attention_reference` (rows ``0..len(query)`` of
    ``block_tables``/``seq_lens``; ``max_seq_len`` >= every ``seq_lens[i]``, a host int).
    ``out`` (optional) receives the result; ``partition_size``/``block_n`` override the tiling
    (tests use them to get several partitions out of short contexts)."""
    check_kv_cache(k_cache, v_cache)
    _, block_size, kv_heads, head_dim = k_cache.shape
    device = k_cache.device
    check_launch_device("k_cache", k_cache)
    check_tensor("query", query, ndim=3, dtype=k_cache.dtype, device=device)
    num_seqs, num_heads, _ = query.shape
    if query.shape[2] != head_dim or num_heads % kv_heads:
        raise ValueError(f"query: expected [seqs, a multiple of {kv_heads} heads, {head_dim}], "
                         f"got {list(query.shape)}")
    check_tensor("block_tables", block_tables, ndim=2, dtype=torch.int32, device=device)
    if block_tables.shape[0] < num_seqs or block_tables.stride(1) != 1:
        raise ValueError(f"block_tables: expected >= {num_seqs} rows with contiguous rows, "
                         f"got shape {list(block_tables.shape)} strides {block_tables.stride()}")
    check_tensor("seq_lens", seq_lens, ndim=1, dtype=torch.int32, device=device, contiguous=True)
    if seq_lens.shape[0] < num_seqs:
        raise ValueError(f"seq_lens: {seq_lens.shape[0]} entries for {num_seqs} sequences")
    capacity = block_tables.shape[1] * block_size
    if not 0 <= max_seq_len <= capacity:
        raise ValueError(f"max_seq_len: {max_seq_len} is outside the block table's 0..{capacity} slots")
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=device)
    else:
        check_tensor("out", out, shape=query.shape, dtype=query.dtype, device=device)
    check_tiling(block_n, partition_size)
    return launch_decode(query, k_cache, v_cache, block_tables, seq_lens, max_seq_len, scale, out,
                         partition_size, block_n)


def check_tiling(block_n: int | None, partition_size: int | None) -> None:
    if block_n is not None and (block_n < 16 or block_n & (block_n - 1)):
        raise ValueError(f"block_n: expected a power of two >= 16, got {block_n}")
    if partition_size is not None and (partition_size <= 0 or partition_size % (block_n or DEFAULT_BLOCK_N)):
        raise ValueError(f"partition_size: expected a positive multiple of block_n="
                         f"{block_n or DEFAULT_BLOCK_N}, got {partition_size}")


def launch_decode(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    scale: float,
    out: torch.Tensor,
    partition_size: int | None,
    block_n: int | None,
) -> torch.Tensor:
    """The launch without the argument checks (the caller has made them)."""
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, kv_heads, _ = k_cache.shape
    device = query.device
    if num_seqs == 0 or max_seq_len == 0:
        return out.zero_() if max_seq_len == 0 else out
    group = num_heads // kv_heads
    block_n = block_n or DEFAULT_BLOCK_N
    if partition_size is None:
        partition_size = choose_partition_size(num_seqs, kv_heads, max_seq_len, block_n, device)
    num_partitions = cdiv(max_seq_len, partition_size)
    split = num_partitions > 1
    block_g = max(16, next_power_of_2(group))
    block_d = max(16, next_power_of_2(head_dim))
    scale_log2e = float(scale) * LOG2E
    if split:
        part_out = torch.empty((num_seqs, num_heads, num_partitions, head_dim), dtype=torch.float32, device=device)
        part_max = torch.empty((num_seqs, num_heads, num_partitions), dtype=torch.float32, device=device)
        part_sum = torch.empty_like(part_max)
    else:
        part_out = part_max = part_sum = out  # unused
    _decode_partition_kernel[(num_seqs, kv_heads, num_partitions)](
        out, part_out, part_max, part_sum, query, k_cache, v_cache, block_tables, seq_lens,
        scale_log2e, query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        partition_size, num_partitions, max_seq_len,
        GROUP=group, BLOCK_G=block_g, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_SIZE=block_size,
        BLOCK_N=block_n, SPLIT=split, DOT_PRECISION=_dot_precision(query.dtype),
        num_warps=4,
    )
    if split:
        _decode_reduce_kernel[(num_seqs, num_heads)](
            out, part_out, part_max, part_sum, seq_lens, out.stride(0), out.stride(1),
            partition_size, num_partitions, max_seq_len,
            HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_P=min(32, next_power_of_2(num_partitions)),
            num_warps=4,
        )
    return out
