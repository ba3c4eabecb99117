"""Attention over the paged KV cache for a batch that mixes decodes and prefill chunks.

Composes the two attention ops: rows ``0..num_decodes`` go to decode attention (one token per
sequence), the rest to prefill attention. The torch reference runs everywhere: decodes are
batched into padded scaled_dot_product_attention calls, one per bucket of similar context
lengths (see :func:`length_buckets`), prefill chunks go one sequence at a time. The CPU path
runs every row through the native decode kernel of :mod:`triode.kernels.cpu_attention`, which
reads the cache in place: a prefill token at position p is the decode of a sequence p + 1
tokens long. Each row's reduction order then depends on its sequence alone, never on the
step's batch (a token recomputed after a restart or a preemption, or read from the prefix
cache, gets the bits it had), and on this CPU it was faster than the reference's prefill
(docs/benchmarks.md). The Triton version launches the decode kernel(s) and the prefill kernel
into one output tensor.

Under :func:`~triode.kernels.invariance.batch_invariant` the other two paths take every row as a
decode too: the reference one row at a time (its padded batches and prefill chunks sum in
orders that follow the batch), the Triton one through the decode kernel with its fixed tiling.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from triode.kernels.attention_checks import (
    check_attention_args,
    check_decode_metadata,
    check_host_metadata,
    once_per_step,
)
from triode.kernels.checks import (
    check_launch_device,
    check_score_rules,
    check_tensor,
)
from triode.kernels.cpu_attention import cpu_decode_supports, paged_decode_cpu
from triode.kernels.decode_attention import check_tiling, decode_attention_reference, launch_decode
from triode.kernels.invariance import batch_invariant
from triode.kernels.metadata import AttentionMetadata
from triode.kernels.prefill_attention import gather_kv, launch_prefill, prefill_attention_reference

__all__ = [
    "gather_kv",
    "length_buckets",
    "paged_attention_cpu",
    "paged_attention_reference",
    "paged_attention_triton",
]


def paged_attention_reference(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    *,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """query [tokens, heads, dim]; key/value [tokens, kv_heads, dim] are this step's (already
    written to the cache). Returns [tokens, heads, dim]. With a sliding ``window`` a query sees
    the last ``window`` keys up to itself; ``softcap`` caps each scaled score s at softcap *
    tanh(s / softcap)."""
    check_score_rules(window, softcap)
    rules = {"window": window, "softcap": softcap}
    if batch_invariant():
        return _rows_one_at_a_time(query, k_cache, v_cache, metadata, scale, **rules)
    out = torch.empty_like(query)
    num_decodes = metadata.num_decodes
    if num_decodes:
        for rows, longest in _decode_buckets(metadata, k_cache.shape[1]):
            if rows is None:
                out[:num_decodes] = decode_attention_reference(
                    query[:num_decodes], k_cache, v_cache, metadata.block_tables,
                    metadata.seq_lens, longest, scale, **rules,
                )
                continue
            out.index_copy_(0, rows, decode_attention_reference(
                query.index_select(0, rows), k_cache, v_cache,
                metadata.block_tables.index_select(0, rows), metadata.seq_lens.index_select(0, rows),
                longest, scale, **rules,
            ))
    if num_decodes < metadata.num_seqs:
        prefill_attention_reference(query, key, value, k_cache, v_cache, metadata, scale, out, **rules)
    return out


def _rows_one_at_a_time(query, k_cache, v_cache, metadata: AttentionMetadata, scale: float,
                        **rules) -> torch.Tensor:
    """The reference's batch-invariant form: each row the decode of its own context, alone."""
    tables, seq_lens = _rows_as_decodes(metadata)
    block_size = k_cache.shape[1]
    out = torch.empty_like(query)
    for row, length in enumerate(seq_lens.tolist()):
        out[row:row + 1] = decode_attention_reference(
            query[row:row + 1], k_cache, v_cache, tables[row:row + 1], seq_lens[row:row + 1],
            -(-length // block_size) * block_size, scale, **rules)
    return out


def paged_attention_cpu(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    *,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """As :func:`paged_attention_reference`, with every row read from the cache in place by
    the native CPU decode kernel when it is built and fits these tensors."""
    rules = {"window": window, "softcap": softcap}
    if not cpu_decode_supports(query, k_cache):
        return paged_attention_reference(query, key, value, k_cache, v_cache, metadata, scale, **rules)
    check_score_rules(window, softcap)
    check_decode_metadata(metadata, k_cache)
    out = torch.empty_like(query)
    tables, seq_lens = _rows_as_decodes(metadata)
    paged_decode_cpu(query, k_cache, v_cache, tables, seq_lens, scale, out, **rules)
    return out


# A bucket's sequences are padded to its longest; a shorter one starts a new bucket once the
# padding would exceed this share of its length, unless the bucket is short anyway (then one
# more call costs more than the padding). Measured on the CPU path at 128 decodes with 16-528
# token contexts: one padded call 8.4 ms per layer, about half of it spent on padding.
BUCKET_MIN_SHARE = 0.7
BUCKET_FLOOR_TOKENS = 128


def length_buckets(lengths: Sequence[int], block_size: int) -> list[tuple[list[int], int]]:
    """Groups sequence indices by context length: (indices, padded length) per group, longest
    group first. Lengths are padded to whole blocks, as the gather reads them."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i], reverse=True)
    buckets: list[tuple[list[int], int]] = []
    for index in order:
        padded = -(-lengths[index] // block_size) * block_size
        if buckets:
            members, longest = buckets[-1]
            if longest <= BUCKET_FLOOR_TOKENS or padded >= BUCKET_MIN_SHARE * longest:
                members.append(index)
                continue
        buckets.append(([index], padded))
    return buckets


@once_per_step
def _decode_buckets(metadata: AttentionMetadata, block_size: int) -> list:
    """(row indices, or None for all the decodes, padded length) per bucket."""
    buckets = length_buckets(metadata.seq_lens_host[:metadata.num_decodes], block_size)
    device = metadata.seq_lens.device
    return [(None, longest) if len(buckets) == 1 else
            (torch.tensor(members, dtype=torch.long, device=device), longest)
            for members, longest in buckets]


@once_per_step
def _rows_as_decodes(metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """(block table, context length) of every query row: a prefill chunk's token at position
    p is a decode of a sequence p + 1 tokens long, so that it is computed exactly as it would be
    one token at a time."""
    num_decodes, starts = metadata.num_decodes, metadata.query_start_loc_host
    if num_decodes == metadata.num_seqs:
        return metadata.block_tables, metadata.seq_lens
    counts = torch.tensor([starts[s + 1] - starts[s] for s in range(metadata.num_seqs)])
    owner = torch.repeat_interleave(torch.arange(metadata.num_seqs), counts)
    rows = torch.arange(len(owner))
    # a row's distance from its chunk's last token, subtracted from the sequence's length
    back = torch.tensor(starts[1:])[owner] - 1 - rows
    lengths = (torch.tensor(metadata.seq_lens_host)[owner] - back).to(torch.int32)
    device = metadata.block_tables.device
    tables = metadata.block_tables.index_select(0, owner.to(device)).contiguous()
    return tables, lengths.to(device).contiguous()


def paged_attention_triton(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    *,
    partition_size: int | None = None,
    block_n: int | None = None,
    block_m: int | None = None,
    out: torch.Tensor | None = None,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Same result as :func:`paged_attention_reference` (reads every key from the cache, so
    the step's keys must have been written first). ``partition_size``/``block_n``/``block_m``
    override the tiling, except under :func:`batch_invariant`; ``out`` (optional, [tokens,
    heads, dim]) receives the result."""
    check_attention_args(query, k_cache, v_cache, metadata)
    check_score_rules(window, softcap)
    check_launch_device("query", query)
    if partition_size is not None or block_n is not None or block_m is not None:
        check_tiling(block_n, partition_size)
        if block_m is not None and (block_m < 16 or block_m & (block_m - 1)):
            raise ValueError(f"block_m: expected a power of two >= 16, got {block_m}")
    capacity = metadata.block_tables.shape[1] * k_cache.shape[1]
    max_decode_len, max_chunk = check_host_metadata(metadata, capacity)
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    else:
        check_tensor("out", out, shape=query.shape, dtype=query.dtype, device=query.device)
    num_decodes, num_seqs = metadata.num_decodes, metadata.num_seqs
    if batch_invariant():
        tables, seq_lens = _rows_as_decodes(metadata)
        return launch_decode(query, k_cache, v_cache, tables, seq_lens, metadata.max_seq_len, scale, out,
                             None, None, window=window, softcap=softcap, invariant=True)
    if num_decodes:
        launch_decode(
            query[:num_decodes], k_cache, v_cache, metadata.block_tables,
            metadata.seq_lens[:num_decodes], max_decode_len, scale, out[:num_decodes],
            partition_size, block_n, window=window, softcap=softcap,
        )
    if num_decodes < num_seqs:
        launch_prefill(
            query, k_cache, v_cache, metadata.block_tables, metadata.seq_lens,
            metadata.query_start_loc, scale, num_decodes, num_seqs, max_chunk, out, block_m, block_n,
            window=window, softcap=softcap,
        )
    return out
