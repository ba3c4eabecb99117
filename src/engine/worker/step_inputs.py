"""Flattening a step's chunks into the tensors one forward pass needs."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import attrs
import torch

from triode.engine.worker.block_tables import BlockTables
from triode.engine.worker.input_staging import InputStaging
from triode.engine.worker_messages import ScheduledChunk
from triode.kernels import AttentionMetadata


@attrs.frozen(kw_only=True)
class StepInputs:
    token_ids: torch.Tensor  # [tokens] int64
    positions: torch.Tensor  # [tokens] int64
    metadata: AttentionMetadata
    first_token_rows: tuple[int, ...]  # per chunk, its first row in the flattened batch
    last_token_rows: tuple[int, ...]

    @classmethod
    def build(
        cls,
        chunks: Sequence[ScheduledChunk],
        chunk_token_ids: Sequence[Sequence[int]],
        tables: BlockTables,
        *,
        block_size: int,
        device: torch.device,
        staging: InputStaging | None = None,
    ) -> StepInputs:
        """``chunks`` must be ordered decodes (one token) first; ``chunk_token_ids[i]`` is
        chunk i's input tokens (``StepPlan.chunk_token_ids``); ``tables`` holds every chunk's
        sequence, its table already extended by this step's new blocks. The per-sequence work
        is a few list comprehensions; slots and tables are gathered with tensor indexing.
        ``staging``: the tensors go to ``device`` in its one copy (a GPU worker's), not one
        copy each."""
        rows = [tables.row(chunk.seq_id) for chunk in chunks]
        firsts = [chunk.start_position for chunk in chunks]
        counts = [len(tokens) for tokens in chunk_token_ids]
        ends = [first + count for first, count in zip(firsts, counts, strict=True)]
        capacity = [tables.lengths[row] * block_size for row in rows]
        if any(end > room for end, room in zip(ends, capacity, strict=True)):
            index = next(i for i, (end, room) in enumerate(zip(ends, capacity, strict=True)) if end > room)
            raise ValueError(f"sequence {chunks[index].seq_id!r}: {ends[index]} tokens need more than its "
                             f"{capacity[index] // block_size} blocks of {block_size}")
        num_decodes = next((i for i, count in enumerate(counts) if count != 1), len(chunks))
        row_ids = torch.tensor(rows, dtype=torch.int64)
        if num_decodes == len(chunks):  # the common step: one token per sequence
            token_ids = [tokens[0] for tokens in chunk_token_ids]
            positions = torch.tensor(firsts, dtype=torch.int64)
            token_rows = row_ids
        else:
            token_ids = [token for tokens in chunk_token_ids for token in tokens]
            positions = torch.cat([torch.arange(first, end) for first, end in zip(firsts, ends, strict=True)])
            token_rows = row_ids.repeat_interleave(torch.tensor(counts))
        table = tables.table
        slots = table[token_rows, positions // block_size].to(torch.int64) * block_size + positions % block_size
        starts = list(itertools.accumulate(counts, initial=0))
        width = max(tables.lengths[row] for row in rows)

        host = [slots, torch.tensor(starts, dtype=torch.int32), torch.tensor(ends, dtype=torch.int32),
                table[:, :width].index_select(0, row_ids), torch.tensor(token_ids, dtype=torch.int64), positions]
        if staging is not None:
            on_device = staging.upload(host)
        else:
            on_device = [values.to(device, non_blocking=True) for values in host]
        slot_mapping, query_start_loc, seq_lens, block_tables, token_id_rows, position_rows = on_device
        metadata = AttentionMetadata(
            slot_mapping=slot_mapping,
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            block_tables=block_tables,
            num_decodes=num_decodes,
            max_query_len=max(counts),
            max_seq_len=max(ends),
            query_start_loc_host=tuple(starts),
            seq_lens_host=tuple(ends),
        )
        return cls(
            token_ids=token_id_rows,
            positions=position_rows,
            metadata=metadata,
            first_token_rows=tuple(starts[:-1]),
            last_token_rows=tuple(s - 1 for s in starts[1:]),
        )
