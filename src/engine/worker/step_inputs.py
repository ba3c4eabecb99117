"""Flattening a step's chunks into the tensors one forward pass needs."""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

from engine.worker_messages import ScheduledChunk
from kernels import AttentionMetadata


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
        block_tables: Sequence[Sequence[int]],
        *,
        block_size: int,
        device: torch.device,
    ) -> StepInputs:
        """``chunks`` must be ordered decodes (one token) first; ``chunk_token_ids[i]`` is
        chunk i's input tokens (``StepPlan.chunk_token_ids``), ``block_tables[i]`` its full
        block table, already extended by this step's new blocks."""
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        starts = [0]
        seq_lens: list[int] = []
        for chunk, chunk_tokens, table in zip(chunks, chunk_token_ids, block_tables, strict=True):
            first = chunk.start_position
            last = first + len(chunk_tokens)
            if last > len(table) * block_size:
                raise ValueError(
                    f"sequence {chunk.seq_id!r}: {last} tokens need more than its "
                    f"{len(table)} blocks of {block_size}"
                )
            token_ids.extend(chunk_tokens)
            span = range(first, last)
            positions.extend(span)
            slots.extend(table[p // block_size] * block_size + p % block_size for p in span)
            starts.append(starts[-1] + len(chunk_tokens))
            seq_lens.append(last)
        width = max(len(table) for table in block_tables)
        padded = [list(table) + [0] * (width - len(table)) for table in block_tables]
        num_decodes = next((i for i, t in enumerate(chunk_token_ids) if len(t) != 1), len(chunks))

        def tensor(values, dtype):
            return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

        metadata = AttentionMetadata(
            slot_mapping=tensor(slots, torch.int64),
            query_start_loc=tensor(starts, torch.int32),
            seq_lens=tensor(seq_lens, torch.int32),
            block_tables=tensor(padded, torch.int32),
            num_decodes=num_decodes,
            max_query_len=max(len(t) for t in chunk_token_ids),
            max_seq_len=max(seq_lens),
            query_start_loc_host=tuple(starts),
            seq_lens_host=tuple(seq_lens),
        )
        return cls(
            token_ids=tensor(token_ids, torch.int64),
            positions=tensor(positions, torch.int64),
            metadata=metadata,
            first_token_rows=tuple(starts[:-1]),
            last_token_rows=tuple(s - 1 for s in starts[1:]),
        )
