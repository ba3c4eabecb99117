"""What the paged attention ops check before a kernel reads the KV cache: the arguments'
shapes, dtypes and devices, and the metadata's bounds (offsets, lengths within each block
table, block ids within the cache), which the native and Triton kernels trust. Every layer of
a step passes the same metadata, so what depends on it alone is computed once per step
(``once_per_step``)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar

import torch

from triode.kernels.checks import check_kv_cache, check_tensor
from triode.kernels.metadata import AttentionMetadata

_T = TypeVar("_T")

__all__ = ["check_attention_args", "check_decode_metadata", "check_host_metadata", "once_per_step"]


def once_per_step(compute: Callable[..., _T]) -> Callable[..., _T]:
    """Every layer of a step passes the same metadata: ``compute`` runs once per step (the
    last metadata and arguments are kept, not a growing cache)."""
    last: list = [None, None, None]

    @functools.wraps(compute)
    def cached(metadata: AttentionMetadata, *arguments: int) -> _T:
        if last[0] is not metadata or last[1] != arguments:
            last[:] = [metadata, arguments, compute(metadata, *arguments)]
        return last[2]

    return cached


def check_decode_metadata(metadata: AttentionMetadata, k_cache: torch.Tensor) -> None:
    """The checks of what the native decode kernel reads and trusts (lengths within each
    block table, block ids within the cache, int32 rows it can stride over); each runs once
    per step, not per layer."""
    tables, seq_lens = metadata.block_tables, metadata.seq_lens
    if not (tables.dtype == seq_lens.dtype == torch.int32 and tables.dim() == 2
            and tables.shape[0] >= metadata.num_seqs and tables.stride(1) == 1
            and seq_lens.shape == (metadata.num_seqs,) and seq_lens.is_contiguous()):
        raise ValueError("block_tables and seq_lens: int32, a contiguous row and a length per sequence")
    check_host_metadata(metadata, tables.shape[1] * k_cache.shape[1])
    _check_block_ids(metadata, k_cache.shape[0])


@once_per_step
def _check_block_ids(metadata: AttentionMetadata, num_blocks: int) -> None:
    tables = metadata.block_tables
    if tables.numel() and not 0 <= int(tables.min()) <= int(tables.max()) < num_blocks:
        raise ValueError(f"block_tables: block ids must lie in [0, {num_blocks}), got "
                         f"{int(tables.min())}..{int(tables.max())}")


def check_attention_args(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
) -> None:
    check_kv_cache(k_cache, v_cache)
    _, _, kv_heads, head_dim = k_cache.shape
    device = k_cache.device
    check_tensor("query", query, ndim=3, dtype=k_cache.dtype, device=device)
    num_tokens, num_heads, query_dim = query.shape
    if query_dim != head_dim or num_heads % kv_heads:
        raise ValueError(
            f"query: expected [tokens, a multiple of {kv_heads} heads, {head_dim}], got {list(query.shape)}"
        )
    num_seqs = metadata.num_seqs
    check_tensor("query_start_loc", metadata.query_start_loc, shape=(num_seqs + 1,),
                 dtype=torch.int32, device=device, contiguous=True)
    check_tensor("seq_lens", metadata.seq_lens, shape=(num_seqs,), dtype=torch.int32,
                 device=device, contiguous=True)
    check_tensor("block_tables", metadata.block_tables, ndim=2, dtype=torch.int32,
                 device=device, contiguous=True)
    if metadata.block_tables.shape[0] < num_seqs:
        raise ValueError(f"block_tables: {metadata.block_tables.shape[0]} rows for {num_seqs} sequences")
    capacity = metadata.block_tables.shape[1] * k_cache.shape[1]
    if metadata.max_seq_len > capacity:
        raise ValueError(f"seq_lens: max {metadata.max_seq_len} exceeds the block table's {capacity} slots")
    if metadata.query_start_loc_host[-1] != num_tokens:
        raise ValueError(f"query_start_loc: ends at {metadata.query_start_loc_host[-1]}, query has {num_tokens} rows")


@once_per_step
def check_host_metadata(metadata: AttentionMetadata, capacity: int) -> tuple[int, int]:
    """Checks the host copies that bound what the kernels read; returns (max decode seq_len,
    max prefill chunk length)."""
    starts, seq_lens = metadata.query_start_loc_host, metadata.seq_lens_host
    num_decodes, num_seqs = metadata.num_decodes, metadata.num_seqs
    if len(starts) != num_seqs + 1 or starts[0] != 0:
        raise ValueError(f"query_start_loc: expected {num_seqs + 1} offsets starting at 0, got {len(starts)}")
    if not 0 <= num_decodes <= num_seqs or starts[num_decodes] != num_decodes:
        raise ValueError(f"num_decodes: {num_decodes} decodes must own one query row each "
                         f"(query_start_loc[{num_decodes}] = {starts[min(num_decodes, num_seqs)]})")
    max_decode_len = max_chunk = 0
    for seq in range(num_seqs):
        chunk, seq_len = starts[seq + 1] - starts[seq], seq_lens[seq]
        if chunk < 0 or seq_len < chunk or seq_len > capacity:
            raise ValueError(f"seq_lens: sequence {seq} has {seq_len} tokens for a chunk of {chunk} "
                             f"and a block table of {capacity} slots")
        if seq < num_decodes:
            max_decode_len = max(max_decode_len, seq_len)
        else:
            max_chunk = max(max_chunk, chunk)
    return max_decode_len, max_chunk
