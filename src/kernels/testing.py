"""Random paged batches for the kernel tests and the GPU check (torch only, vectorised so that
it builds GPU-sized batches quickly).

A batch is a list of sequences ``(prefix_len, chunk_len)``: decodes first (chunk 1), then
prefill chunks. Every cached token gets random K/V; with ``poison`` every slot no sequence owns
(the tail of a last block, spare blocks, block-table padding) holds NaN, so a kernel that reads
past a sequence's context produces NaN instead of passing by luck. The torch references read
whole blocks, so compare them on :meth:`PagedBatch.clean_caches`.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from triode.kernels._jit import import_triton
from triode.kernels.metadata import AttentionMetadata

__all__ = ["PagedBatch", "make_paged_batch", "rope_cache", "triton_interpreter"]


@contextlib.contextmanager
def triton_interpreter() -> Iterator[None]:
    """Run the Triton kernels in triton's interpreter (on CPU tensors) inside the block.

    Sets ``TRITON_INTERPRET=1`` for the block (imports triton under it if nothing has yet; if
    triton is already imported in compile mode, triode.kernels._jit still runs the kernels
    interpreted). Combine with ``kernels.set_backend("triton")`` to force the kernels on CPU.

    Inside the block ``tl.dot`` gives each row of a tile the same sum wherever the row sits in
    it, as a GPU's matrix units do: the interpreter's own dot is numpy's matmul, whose BLAS
    (OpenBLAS) sums a row in an order that follows its place in the tile on some CPUs (an AMD
    EPYC Zen 5: 429 of 1600 rows of a 32 x 32 by 32 x 64 product changed bits when the rows
    were permuted), so a batch-invariant kernel would look variant only in the interpreter."""
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import_triton(interpret=True)
        with _dot_by_rows():
            yield
    finally:
        if previous is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = previous


@contextlib.contextmanager
def _dot_by_rows() -> Iterator[None]:
    """The interpreter's ``tl.dot`` through numpy's einsum (its own loops, no BLAS: the same
    order for every row), for the float operands triode's kernels use; 8-bit floats keep the
    interpreter's conversion."""
    import numpy as np
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    original = builder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if any(x.dtype.primitive_bitwidth == 8 and x.dtype.is_floating() for x in (a, b)):
            return original(self, a, b, d, input_precision, max_num_imprecise_acc)
        product = np.einsum("...mk,...kn->...mn", a.data, b.data, dtype=d.data.dtype)
        return interpreter.TensorHandle(product + d.data, d.dtype.scalar)

    builder.create_dot = create_dot
    try:
        yield
    finally:
        builder.create_dot = original


@dataclass
class PagedBatch:
    query: torch.Tensor  # [tokens, heads, dim]
    key: torch.Tensor  # [tokens, kv_heads, dim]: the step's new keys (already in the cache)
    value: torch.Tensor
    k_cache: torch.Tensor  # [num_blocks, block_size, kv_heads, dim]
    v_cache: torch.Tensor
    metadata: AttentionMetadata
    scale: float

    def clean_caches(self, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The caches with the poison replaced by zeros (optionally cast)."""
        return tuple(torch.nan_to_num(c.to(dtype or c.dtype), nan=0.0) for c in (self.k_cache, self.v_cache))

    @property
    def kv_bytes(self) -> int:
        """Bytes of K and V the batch's attention has to read."""
        per_token = self.k_cache.shape[2] * self.k_cache.shape[3] * self.k_cache.element_size()
        return 2 * per_token * sum(self.metadata.seq_lens_host)


def make_paged_batch(
    seqs: list[tuple[int, int]],
    *,
    num_decodes: int,
    kv_heads: int,
    group: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    poison: bool = True,
    spare_blocks: int = 2,
    seed: int = 0,
) -> PagedBatch:
    """``seqs``: (prefix_len, chunk_len) per sequence, the first ``num_decodes`` with chunk 1."""
    device = torch.device(device)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    data_gen = torch.Generator(device=device).manual_seed(seed + 1)
    prefixes = torch.tensor([p for p, _ in seqs], dtype=torch.int64)
    chunks = torch.tensor([c for _, c in seqs], dtype=torch.int64)
    if num_decodes and bool((chunks[:num_decodes] != 1).any()):
        raise ValueError("decodes must have a chunk of 1 token")
    seq_lens = prefixes + chunks
    num_seqs = len(seqs)
    blocks_per_seq = (seq_lens + block_size - 1) // block_size
    width = int(blocks_per_seq.max()) + 1 if num_seqs else 1
    used = int(blocks_per_seq.sum())
    num_blocks = used + spare_blocks
    order = torch.randperm(num_blocks, generator=gen)
    spare = order[used:]
    fill = int(spare[0]) if spare_blocks else 0
    block_tables = torch.full((max(num_seqs, 1), width), fill, dtype=torch.int32)
    offset = 0
    for seq in range(num_seqs):
        count = int(blocks_per_seq[seq])
        block_tables[seq, :count] = order[offset:offset + count].to(torch.int32)
        offset += count

    # Flat slot of every cached token, and which of them are this step's.
    total = int(seq_lens.sum())
    seq_ids = torch.repeat_interleave(torch.arange(num_seqs), seq_lens)
    seq_starts = torch.cumsum(seq_lens, 0) - seq_lens
    token_pos = torch.arange(total) - seq_starts[seq_ids]
    slots = block_tables[seq_ids, token_pos // block_size].long() * block_size + token_pos % block_size
    is_new = token_pos >= prefixes[seq_ids]

    heads = kv_heads * group
    shape = (num_blocks * block_size, kv_heads, head_dim)
    fill_value = float("nan") if poison else 0.0
    caches = []
    for _ in range(2):
        flat = torch.full(shape, fill_value, dtype=dtype, device=device)
        flat[slots.to(device)] = torch.randn((total, kv_heads, head_dim), generator=data_gen,
                                             device=device).to(dtype)
        caches.append(flat.view(num_blocks, block_size, kv_heads, head_dim))
    k_cache, v_cache = caches
    new_slots = slots[is_new].to(device)
    key = k_cache.view(shape)[new_slots].clone()
    value = v_cache.view(shape)[new_slots].clone()
    num_tokens = int(chunks.sum())
    query = torch.randn((num_tokens, heads, head_dim), generator=data_gen, device=device).to(dtype)

    starts = [0]
    for chunk in chunks.tolist():
        starts.append(starts[-1] + chunk)
    lens = tuple(int(n) for n in seq_lens.tolist())
    metadata = AttentionMetadata(
        slot_mapping=new_slots,
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        block_tables=block_tables.to(device),
        num_decodes=num_decodes,
        max_query_len=max(chunks.tolist(), default=0),
        max_seq_len=max(lens, default=0),
        query_start_loc_host=tuple(starts),
        seq_lens_host=lens,
    )
    return PagedBatch(query, key, value, k_cache, v_cache, metadata, head_dim ** -0.5)


def rope_cache(max_positions: int, head_dim: int, base: float = 10000.0,
               device: torch.device | str = "cpu") -> torch.Tensor:
    """[max_positions, head_dim] float32: cos of the neox frequencies, then sin."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(device)
