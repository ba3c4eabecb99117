"""A CPU KV cache's pages committed before a step writes them, by the step's whole thread team.

The cache lies in lazily mapped memory (:func:`host_memory.zeroed_tensor`), so that a budget
sized from the machine's memory costs only what sequences use. Its pages were then faulted in
by the step that first wrote each block: one 4 KiB page at a time, inside the serial copy of
the step's keys and values, while the other core waited. A cache written through once at
start-up took W1v in bfloat16 (AMD EPYC Zen 5, two cores, 4 GiB of KV) from 25.0 to 23.3 s,
at 7 s more start-up and the whole budget committed; committing here, 24.6 to 23.8 s.

The block manager hands out blocks no sequence has used in increasing id order (its free queue
starts as 0, 1, 2, ... and a freed block goes back before or after them, never among them), and
so does a draft model's proposer for its own cache: the blocks with pages are a prefix of the
ids. :class:`KVPages` extends that prefix to the highest block a step's tables hold, just
before the step, through ``csrc/pages.c`` (``MADV_POPULATE_WRITE``, with the OpenMP team
sharing the cache's tensors). Memory is still committed only for blocks handed out.

Where the kernel lacks ``MADV_POPULATE_WRITE`` (Linux < 5.14), without the C kernels, or once a
commit fails (memory ran out), the pages are left to fault in as before; the reason is logged.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
from collections.abc import Sequence

import torch

from triode.kernels.native import bind

logger = logging.getLogger(__name__)

__all__ = ["KVPages", "kv_pages_for"]


class KVPages:
    def __init__(self, caches: Sequence[torch.Tensor]) -> None:
        """``caches``: every CPU cache tensor of the rank, each [blocks, ...] and contiguous,
        all with the same number of blocks."""
        if not caches or any(cache.device.type != "cpu" or not cache.is_contiguous() for cache in caches):
            raise ValueError("KVPages takes contiguous CPU cache tensors")
        blocks = {cache.shape[0] for cache in caches}
        if len(blocks) != 1:
            raise ValueError(f"the caches differ in blocks: {sorted(blocks)}")
        self.num_blocks = blocks.pop()
        self.committed_blocks = 0  # blocks [0, committed_blocks) have their pages
        self._starts = [cache.data_ptr() for cache in caches]
        self._block_bytes = [cache.nbytes // max(self.num_blocks, 1) for cache in caches]
        self._populate = _populate_function()
        self._disabled = self._populate is None

    def commit_through(self, block: int) -> None:
        """Commits the pages of blocks up to and including ``block``, if not yet committed."""
        if block < self.committed_blocks or self._disabled:
            return
        end = min(block + 1, self.num_blocks)
        starts, lengths = [], []
        for base, block_bytes in zip(self._starts, self._block_bytes, strict=True):
            first = (base + self.committed_blocks * block_bytes) // mmap.PAGESIZE * mmap.PAGESIZE
            last = -(-(base + end * block_bytes) // mmap.PAGESIZE) * mmap.PAGESIZE
            starts.append(first)
            lengths.append(last - first)
        count = len(starts)
        status = self._populate((ctypes.c_int64 * count)(*starts), (ctypes.c_int64 * count)(*lengths), count)
        if status:
            self._disabled = True
            reason = "this kernel has no MADV_POPULATE_WRITE" if status == errno.EINVAL else os.strerror(status)
            logger.warning("KV cache pages are left to fault in as steps write them: %s", reason)
            return
        self.committed_blocks = end


def kv_pages_for(kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> KVPages | None:
    """The pages of a rank's (key, value) caches, per layer; None for caches not on a CPU or
    of no blocks (an encoder's), which have nothing to commit."""
    caches = [cache for pair in kv_caches for cache in pair]
    if not caches or caches[0].device.type != "cpu" or caches[0].shape[0] == 0:
        return None
    return KVPages(caches)


def _populate_function():
    pointer, i64 = ctypes.c_void_p, ctypes.c_int64
    return bind("triode_populate_pages", pointer, pointer, i64)
