"""Decode attention over the paged KV cache: one query token per sequence, GQA.

The Triton version is flash-decoding (the kernels are in :mod:`triode.kernels.decode_triton`): the
grid is (sequence, kv head, context partition), and a reduction kernel combines the
partitions. This module holds the torch reference, the argument checks, the partition rule
and the launch.
"""

from __future__ import annotations

import functools

import torch

from triode.kernels._jit import cdiv, next_power_of_2
from triode.kernels.checks import (
    check_kv_cache,
    check_launch_device,
    check_score_rules,
    check_tensor,
)
from triode.kernels.decode_triton import (
    LOG2E,
    NO_WINDOW,
    decode_partition_kernel,
    decode_reduce_kernel,
)
from triode.kernels.masked_attention import attention

__all__ = [
    "check_tiling",
    "choose_partition_size",
    "decode_attention_reference",
    "decode_attention_triton",
    "launch_decode",
]

# Programs the decode grid aims for per multiprocessor before it splits contexts further.
PROGRAMS_PER_SM = 8
MIN_PARTITION = 256
DEFAULT_BLOCK_N = 64
# The tiling of a batch-invariant launch: every row's context split at the same places and
# its partitions combined by the same reduction, whatever the batch (the default tiling
# follows the batch's size and longest context).
INVARIANT_PARTITION = 256
INVARIANT_BLOCK_P = 32


def decode_attention_reference(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    scale: float,
    *,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """query [seqs, heads, dim], one token per sequence, attends to its ``seq_lens[i]`` cached
    tokens (the last ``window`` of them with a sliding window; scores soft-capped at ``softcap``).
    Returns [seqs, heads, dim].

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
    if int(lengths.min()) < length or (window is not None and max_seq_len > window):
        positions = torch.arange(length, device=query.device)
        mask = positions[None, :] < lengths[:, None]
        if window is not None:
            mask &= positions[None, :] >= lengths[:, None] - window
        mask = mask[:, None, None, :]
    q = query.view(num_seqs, kv_heads, num_heads // kv_heads, head_dim)
    out = attention(q, keys, values, mask=mask, scale=scale, softcap=softcap)
    return out.reshape(num_seqs, num_heads, head_dim)


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
    window: int | None = None,
    softcap: float | None = None,
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
    check_score_rules(window, softcap)
    return launch_decode(query, k_cache, v_cache, block_tables, seq_lens, max_seq_len, scale, out,
                         partition_size, block_n, window=window, softcap=softcap)


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
    *,
    window: int | None = None,
    softcap: float | None = None,
    invariant: bool = False,
) -> torch.Tensor:
    """The launch without the argument checks (the caller has made them). ``invariant``: the
    batch-invariant tiling (a row's bits depend on its own context alone)."""
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, kv_heads, _ = k_cache.shape
    device = query.device
    if num_seqs == 0 or max_seq_len == 0:
        return out.zero_() if max_seq_len == 0 else out
    group = num_heads // kv_heads
    block_n = block_n or DEFAULT_BLOCK_N
    if invariant:
        partition_size, block_n = INVARIANT_PARTITION, DEFAULT_BLOCK_N
    elif partition_size is None:
        partition_size = choose_partition_size(num_seqs, kv_heads, max_seq_len, block_n, device)
    num_partitions = cdiv(max_seq_len, partition_size)
    # one partition writes its output directly, which rounds otherwise than the reduction
    split = invariant or num_partitions > 1
    block_g = max(16, next_power_of_2(group))
    block_d = max(16, next_power_of_2(head_dim))
    scale_log2e = float(scale) * LOG2E
    if split:
        part_out = torch.empty((num_seqs, num_heads, num_partitions, head_dim), dtype=torch.float32, device=device)
        part_max = torch.empty((num_seqs, num_heads, num_partitions), dtype=torch.float32, device=device)
        part_sum = torch.empty_like(part_max)
    else:
        part_out = part_max = part_sum = out  # unused
    decode_partition_kernel[(num_seqs, kv_heads, num_partitions)](
        out, part_out, part_max, part_sum, query, k_cache, v_cache, block_tables, seq_lens,
        scale_log2e, query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        partition_size, num_partitions, max_seq_len, window or NO_WINDOW, (softcap or 1.0) * LOG2E,
        GROUP=group, BLOCK_G=block_g, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_SIZE=block_size,
        BLOCK_N=block_n, SPLIT=split, DOT_PRECISION=_dot_precision(query.dtype),
        SOFTCAP=softcap is not None, num_warps=4,
    )
    if split:
        decode_reduce_kernel[(num_seqs, num_heads)](
            out, part_out, part_max, part_sum, seq_lens, out.stride(0), out.stride(1),
            partition_size, num_partitions, max_seq_len,
            HEAD_DIM=head_dim, BLOCK_D=block_d,
            BLOCK_P=INVARIANT_BLOCK_P if invariant else min(32, next_power_of_2(num_partitions)),
            num_warps=4,
        )
    return out
