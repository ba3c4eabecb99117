"""Flattening a step's chunks into the tensors one forward pass needs."""

from __future__ import annotations

import itertools
import operator
from collections.abc import Sequence

import attrs
import numpy as np
import torch

from triode.engine.worker.block_tables import BlockTables
from triode.engine.worker.input_staging import InputStaging
from triode.engine.worker_messages import ScheduledChunk
from triode.kernels import AttentionMetadata

_START_POSITION = operator.attrgetter("start_position")
_FIRST = operator.itemgetter(0)


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
        is a few C-level maps; the rest is numpy on arrays of one entry per sequence or token
        (a quarter of torch's cost at these sizes, where its per-operation dispatch dominates),
        handed to torch without a copy.
        ``staging``: the tensors go to ``device`` in its one copy (a GPU worker's), not one
        copy each."""
        num_seqs = len(chunks)
        rows = tables.rows([chunk.seq_id for chunk in chunks])
        firsts = np.fromiter(map(_START_POSITION, chunks), dtype=np.int64, count=num_seqs)
        counts = np.fromiter(map(len, chunk_token_ids), dtype=np.int64, count=num_seqs)
        ends = firsts + counts
        lengths = tables.lengths[rows]
        past = np.flatnonzero(ends > lengths * block_size)
        if past.size:
            index = int(past[0])
            raise ValueError(f"sequence {chunks[index].seq_id!r}: {ends[index]} tokens need more than its "
                             f"{lengths[index]} blocks of {block_size}")
        prefills = np.flatnonzero(counts != 1)
        num_decodes = int(prefills[0]) if prefills.size else num_seqs
        starts = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(counts, out=starts[1:])
        if num_decodes == num_seqs:  # the common step: one token per sequence
            token_ids = np.fromiter(map(_FIRST, chunk_token_ids), dtype=np.int64, count=num_seqs)
            positions, token_rows = firsts, rows
        else:
            num_tokens = int(starts[-1])
            token_ids = np.fromiter(itertools.chain.from_iterable(chunk_token_ids), dtype=np.int64, count=num_tokens)
            positions = np.arange(num_tokens) + np.repeat(firsts - starts[:-1], counts)
            token_rows = np.repeat(rows, counts)
        table = tables.host
        slots = table[token_rows, positions // block_size].astype(np.int64) * block_size + positions % block_size
        host = [torch.from_numpy(values) for values in (
            slots, starts.astype(np.int32), ends.astype(np.int32), table[rows, :int(lengths.max())], token_ids,
            positions)]
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
            max_query_len=int(counts.max()),
            max_seq_len=int(ends.max()),
            query_start_loc_host=tuple(starts.tolist()),
            seq_lens_host=tuple(ends.tolist()),
        )
        return cls(
            token_ids=token_id_rows,
            positions=position_rows,
            metadata=metadata,
            first_token_rows=metadata.query_start_loc_host[:-1],
            last_token_rows=tuple((starts[1:] - 1).tolist()),
        )
