"""Prefill attention for a flattened variable-length batch over the paged KV cache.

Each sequence's new chunk (its rows of the flattened query) attends causally to itself and fully
to its cached prefix; both are read from the paged cache (the step's keys are written before
attention), which is what chunked prefill and prefix caching need. The Triton grid is
(query block, sequence, head); each program streams its sequence's K/V tiles through the block
table with an online softmax in float32, up to its causal limit.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from triode.kernels._jit import cdiv, lazy_jit, next_power_of_2
from triode.kernels.checks import (
    check_kv_cache,
    check_launch_device,
    check_score_rules,
    check_tensor,
)
from triode.kernels.decode_triton import NO_WINDOW
from triode.kernels.masked_attention import attention, visible_keys
from triode.kernels.metadata import AttentionMetadata

if TYPE_CHECKING:
    import triton.language as tl

__all__ = ["gather_kv", "launch_prefill", "prefill_attention_reference", "prefill_attention_triton"]

LOG2E = 1.4426950408889634


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """[length, kv_heads, head_dim] of one sequence, read from its blocks."""
    block_size = cache.shape[1]
    num_blocks = -(-length // block_size)
    blocks = cache.index_select(0, block_table[:num_blocks].long())
    return blocks.flatten(0, 1)[:length]


def _chunk_reference(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    """query [q_len, heads, dim] is the tail of key/value [kv_len, kv_heads, dim]."""
    q_len, kv_len = query.shape[0], key.shape[0]
    q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (query, key, value))
    if q_len == kv_len and (window is None or window >= kv_len):
        out = attention(q, k, v, causal=True, scale=scale, softcap=softcap, enable_gqa=True)
    else:
        rows = torch.arange(q_len, device=query.device)[:, None] + (kv_len - q_len)
        mask = visible_keys(rows, torch.arange(kv_len, device=query.device)[None, :], window)
        out = attention(q, k, v, mask=mask, scale=scale, softcap=softcap, enable_gqa=True)
    return out.squeeze(0).transpose(0, 1)


def prefill_attention_reference(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    out: torch.Tensor,
    *,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Fills ``out``'s rows of the prefill sequences (those after ``metadata.num_decodes``),
    one scaled_dot_product_attention per sequence; a chunk without a cached prefix uses the
    step's own key/value, with a prefix its keys are gathered from the cache. ``window`` and
    ``softcap`` as in :func:`triode.kernels.masked_attention.attention`."""
    starts = metadata.query_start_loc_host
    for seq in range(metadata.num_decodes, metadata.num_seqs):
        start, end, seq_len = starts[seq], starts[seq + 1], metadata.seq_lens_host[seq]
        if end - start == seq_len:
            # No cached prefix: the step's own keys are the whole context, no gather needed.
            k, v = key[start:end], value[start:end]
        else:
            table = metadata.block_tables[seq]
            k, v = gather_kv(k_cache, table, seq_len), gather_kv(v_cache, table, seq_len)
        out[start:end] = _chunk_reference(query[start:end], k, v, scale, window, softcap)
    return out


@lazy_jit
def _prefill_kernel(
    out_ptr,
    query_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    scale_log2e,
    seq_offset,
    num_tokens,
    max_context,
    window,
    softcap_log2e,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    m_block = tl.program_id(0)
    seq = (tl.program_id(1) + seq_offset).to(tl.int64)
    head = tl.program_id(2)
    kv_head = head // GROUP
    q_start = tl.load(query_start_loc_ptr + seq)
    # clamped so that metadata the host could not check never sends a read out of bounds
    q_len = tl.minimum(tl.load(query_start_loc_ptr + seq + 1), num_tokens) - q_start
    if m_block * BLOCK_M >= q_len:
        return
    seq_len = tl.minimum(tl.load(seq_lens_ptr + seq), max_context)
    prefix = seq_len - q_len

    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    m_mask = offs_m < q_len
    d_mask = offs_d < HEAD_DIM
    md_mask = m_mask[:, None] & d_mask[None, :]
    q_rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(query_ptr + q_rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                mask=md_mask, other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    causal_limit = prefix + offs_m  # the last key each row may see
    hi = tl.minimum(seq_len, prefix + (m_block + 1) * BLOCK_M)
    lo = tl.maximum(prefix + m_block * BLOCK_M - window + 1, 0)  # the block's first row's window
    table = block_tables_ptr + seq * stride_bt
    for n0 in range(lo, hi, BLOCK_N):
        tokens = n0 + offs_n
        n_mask = tokens < hi
        blocks = tl.load(table + tokens // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        rows = blocks * stride_cb + (tokens % BLOCK_SIZE) * stride_cs + kv_head * stride_ch
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2e
        if SOFTCAP:  # as in decode_triton
            scores = (2.0 / (1.0 + tl.exp(-2.0 * scores / softcap_log2e)) - 1.0) * softcap_log2e
        visible = ((tokens[None, :] <= causal_limit[:, None]) & (tokens[None, :] > causal_limit[:, None] - window)
                   & n_mask[None, :])
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        # a row whose window starts past this tile has seen no key yet: nothing to rescale
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(scores - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_cache_ptr + rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    l_safe = tl.where(l_i > 0, l_i, 1.0)
    result = acc / l_safe[:, None]
    tl.store(out_ptr + q_rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
             result.to(out_ptr.dtype.element_ty), mask=md_mask)


def _default_blocks(dtype: torch.dtype, head_dim: int) -> tuple[int, int]:
    if dtype == torch.float32 or head_dim > 128:
        return 32, 32
    return 64, 64


def prefill_attention_triton(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    *,
    first_seq: int,
    num_seqs: int,
    max_query_len: int,
    out: torch.Tensor | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention of sequences ``first_seq..num_seqs`` (rows ``query_start_loc[s]:
    query_start_loc[s+1]`` of ``query``, ``seq_lens[s]`` tokens in the cache, the chunk being
    their tail) over the paged cache. ``max_query_len`` (host int) bounds every chunk length.
    Rows of other sequences in ``out`` are left untouched. The caller guarantees (as the
    metadata does) that ``seq_lens[s]`` fits the block table and is >= the chunk length."""
    check_kv_cache(k_cache, v_cache)
    _, _, kv_heads, head_dim = k_cache.shape
    device = k_cache.device
    check_launch_device("k_cache", k_cache)
    check_tensor("query", query, ndim=3, dtype=k_cache.dtype, device=device)
    num_heads = query.shape[1]
    if query.shape[2] != head_dim or num_heads % kv_heads:
        raise ValueError(f"query: expected [tokens, a multiple of {kv_heads} heads, {head_dim}], "
                         f"got {list(query.shape)}")
    check_tensor("query_start_loc", query_start_loc, shape=(num_seqs + 1,), dtype=torch.int32,
                 device=device, contiguous=True)
    check_tensor("seq_lens", seq_lens, shape=(num_seqs,), dtype=torch.int32, device=device, contiguous=True)
    check_tensor("block_tables", block_tables, ndim=2, dtype=torch.int32, device=device)
    if block_tables.shape[0] < num_seqs or block_tables.stride(1) != 1:
        raise ValueError(f"block_tables: expected >= {num_seqs} rows with contiguous rows, "
                         f"got shape {list(block_tables.shape)} strides {block_tables.stride()}")
    if not 0 <= first_seq <= num_seqs:
        raise ValueError(f"first_seq: {first_seq} is outside 0..{num_seqs}")
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=device)
    else:
        check_tensor("out", out, shape=query.shape, dtype=query.dtype, device=device)
    for name, value in (("block_m", block_m), ("block_n", block_n)):
        if value is not None and (value < 16 or value & (value - 1)):
            raise ValueError(f"{name}: expected a power of two >= 16, got {value}")
    check_score_rules(window, softcap)
    return launch_prefill(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                          first_seq, num_seqs, max_query_len, out, block_m, block_n,
                          window=window, softcap=softcap)


def launch_prefill(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    first_seq: int,
    num_seqs: int,
    max_query_len: int,
    out: torch.Tensor,
    block_m: int | None,
    block_n: int | None,
    *,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """The launch without the argument checks (the caller has made them)."""
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, kv_heads, _ = k_cache.shape
    num_prefills = num_seqs - first_seq
    if num_prefills == 0 or max_query_len <= 0 or num_tokens == 0:
        return out
    default_m, default_n = _default_blocks(query.dtype, head_dim)
    block_m, block_n = block_m or default_m, block_n or default_n
    _prefill_kernel[(cdiv(max_query_len, block_m), num_prefills, num_heads)](
        out, query, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
        float(scale) * LOG2E, first_seq, num_tokens, block_tables.shape[1] * block_size,
        window or NO_WINDOW, (softcap or 1.0) * LOG2E,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        GROUP=num_heads // kv_heads, HEAD_DIM=head_dim, BLOCK_D=max(16, next_power_of_2(head_dim)),
        BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_N=block_n,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32", SOFTCAP=softcap is not None,
        num_warps=4 if block_m * block_n <= 4096 else 8,
    )
    return out
