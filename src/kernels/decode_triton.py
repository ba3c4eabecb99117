"""The Triton kernels of decode attention (flash-decoding); :mod:`triode.kernels.decode_attention`
launches them.

The grid is (sequence, kv head, context partition). Each program loads its kv head's K/V
tiles once for all the query heads of its group (a [group, head_dim] x [head_dim, BLOCK_N]
dot), runs an online softmax over its partition and writes a partial result (max, exp-sum,
normalised output); the reduction kernel combines the partitions. With one partition (enough
sequences to fill the GPU) the first kernel writes the output directly and the reduction is
skipped. Everything accumulates in float32.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from triode.kernels._jit import lazy_jit

if TYPE_CHECKING:
    import triton.language as tl

__all__ = ["LOG2E", "NO_WINDOW", "decode_partition_kernel", "decode_reduce_kernel"]

LOG2E = 1.4426950408889634
NO_WINDOW = 1 << 30  # the window argument of a layer that sees its whole context



@lazy_jit
def decode_partition_kernel(
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
    window,
    softcap_log2e,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr,
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
    # keys before the window (NO_WINDOW: none) are skipped; a partition wholly before it writes
    # an empty result
    start = tl.maximum(start, seq_len - window)

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
        if SOFTCAP:
            # softcap * tanh(s / softcap) in the base-2 domain; tanh(y) = 2 / (1 + e^-2y) - 1
            # saturates to +-1 where e^-2y overflows
            scores = (2.0 / (1.0 + tl.exp(-2.0 * scores / softcap_log2e)) - 1.0) * softcap_log2e
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
def decode_reduce_kernel(
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
