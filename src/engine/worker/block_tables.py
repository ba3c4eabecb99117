"""The worker's block tables: one row of an int32 tensor per sequence it holds.

A step's inputs need each scheduled sequence's table (attention reads the KV blocks through
it, the cache write maps positions to slots). Kept as Python lists, a step rebuilt them into a
padded tensor and computed every slot in Python: at 256 decodes of a tiny model that was a
third of the worker's step. Here a plan's new blocks are written into the sequence's row as
they arrive, and a step gathers the rows it needs with one indexing operation
(:class:`triode.engine.worker.step_inputs.StepInputs`), through a numpy view of the same
memory (``host``): on arrays of a few hundred entries numpy's indexing costs a quarter of
torch's, whose per-operation dispatch dominates there.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["BlockTables"]

# Rows allocated up front at most: the tensor doubles when more sequences arrive, so a
# max_num_seqs far beyond what the KV cache holds (10**9: 2 TB of tables at the default
# model's length) costs nothing until that many sequences run.
MAX_INITIAL_ROWS = 1024


class BlockTables:
    def __init__(self, max_blocks: int, *, rows: int = 64) -> None:
        """``max_blocks``: the longest table a sequence may have (max_model_len over the block
        size); ``rows``: sequences held before the tensor grows (it doubles), at most
        :data:`MAX_INITIAL_ROWS`."""
        self.max_blocks = max_blocks
        rows = min(rows, MAX_INITIAL_ROWS)
        self.table = torch.zeros((rows, max_blocks), dtype=torch.int32)
        self.host = self.table.numpy()  # the same memory
        self.lengths = np.zeros(rows, dtype=np.int64)  # blocks in each row's table
        self.highest_block = -1  # the highest block id any table has held (-1: none yet)
        self._rows: dict[str, int] = {}
        self._free = list(range(rows - 1, -1, -1))

    def __contains__(self, seq_id: str) -> bool:
        return seq_id in self._rows

    def row(self, seq_id: str) -> int:
        return self._rows[seq_id]

    def rows(self, seq_ids: list[str]) -> np.ndarray:
        """The rows of ``seq_ids`` (int64)."""
        return np.fromiter(map(self._rows.__getitem__, seq_ids), dtype=np.int64, count=len(seq_ids))

    def add(self, seq_id: str) -> None:
        """A sequence with an empty table (a sequence that restarts gets a fresh one)."""
        if seq_id in self._rows:
            self.remove(seq_id)
        if not self._free:
            self._grow()
        row = self._free.pop()
        self._rows[seq_id] = row
        self.lengths[row] = 0
        self.host[row] = 0  # past its length a row reads as padding, block 0, as before

    def remove(self, seq_id: str) -> None:
        row = self._rows.pop(seq_id, None)
        if row is not None:
            self._free.append(row)

    def extend(self, seq_id: str, block_ids) -> None:
        """Appends blocks to a sequence's table; more than ``max_blocks`` raise ValueError."""
        self.extend_many(((seq_id, block_ids),))

    def extend_many(self, additions) -> None:
        """Appends blocks to several tables, ``(seq_id, block_ids)`` pairs, in one write:
        a step's new blocks, which one write each took 0.1-0.2 ms of a 256-decode step. Nothing
        is written if any table would pass ``max_blocks`` (ValueError)."""
        rows, columns, values, extended, ends = [], [], [], [], []
        lengths = self.lengths
        for seq_id, block_ids in additions:
            if not block_ids:
                continue
            row = self._rows[seq_id]
            start = int(lengths[row])
            end = start + len(block_ids)
            if end > self.max_blocks:
                raise ValueError(f"sequence {seq_id!r}: {end} blocks, more than the {self.max_blocks} a table holds")
            rows.extend([row] * len(block_ids))
            columns.extend(range(start, end))
            values.extend(block_ids)
            extended.append(row)
            ends.append(end)
        if not values:
            return
        self.host[rows, columns] = values
        self.highest_block = max(self.highest_block, max(values))
        lengths[extended] = ends

    def _grow(self) -> None:
        rows = self.table.shape[0]
        self.table = torch.cat([self.table, torch.zeros_like(self.table)])
        self.host = self.table.numpy()
        self.lengths = np.concatenate([self.lengths, np.zeros(rows, dtype=np.int64)])
        self._free.extend(range(2 * rows - 1, rows - 1, -1))
