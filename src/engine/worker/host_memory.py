"""Host memory the worker's steps run fast in: freed memory kept in the heap, and weights in
transparent huge pages.

glibc serves allocations above its mmap threshold (at most 32 MiB) with a fresh ``mmap`` and
unmaps them on free. A step allocates many such tensors (gathered KV, prefill activations),
so every step paid for page faults on memory it had just released: measured here, gathering
53 MB of KV blocks took 23 ms into fresh memory and 3.5 ms into reused memory. A worker is a
dedicated process whose working set repeats every step, so it turns both off; its resident
size then stays at its peak, which is what it needs every step anyway.

A decode step on a CPU streams every weight from memory once. In 4 KiB pages that stream
crosses a page boundary every 4 KiB, where the hardware prefetchers stop and the TLB misses
(a two-level walk under a hypervisor); in 2 MiB pages it does not. Where the kernel gives
huge pages only on request (``transparent_hugepage/enabled`` = madvise, the common default),
weights read from a checkpoint go into mappings that ask for them: :func:`weight_tensor`."""

from __future__ import annotations

import ctypes
import ctypes.util
import math
import mmap
import sys

import torch

HUGE_PAGE = 2 << 20

_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4


def keep_freed_memory() -> bool:
    """Disables glibc's mmap for large blocks and heap trimming in this process; returns
    whether it could (False on other C libraries, where nothing changes)."""
    if not sys.platform.startswith("linux"):
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    return bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))


def weight_tensor(shape: list[int], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized tensor for weights. From one huge page up, it lies in a private
    anonymous mapping of its own whose whole huge pages are advised MADV_HUGEPAGE; the tail
    past the last whole one stays in small pages, so no partly used huge page is resident."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes < HUGE_PAGE or getattr(mmap, "MADV_HUGEPAGE", None) is None:
        return torch.empty(shape, dtype=dtype)
    return _mapped(shape, dtype, nbytes)


def zeroed_tensor(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed tensor, for a KV cache. On a CPU from one huge page up, it lies in a fresh
    anonymous mapping, whose pages read as zeros and are committed only when the blocks on them
    are first used (worker/kv_pages.py): a budget sized from the memory available
    (worker/kv_budget.py) costs what the sequences use, not the whole budget at start-up, and
    is not written through once to zero it.

    Its pages are small ones, even where the kernel gives huge pages unasked: they are
    committed inside a step, and there the kernel took 1.6-3.4 s a GiB to fault in huge pages
    (compacting memory to find each 2 MiB one) against 0.5-0.6 s in small pages, while reads of
    12 KiB blocks at random ran as fast from either (AMD EPYC, 2026-12-04). Committed ahead a
    range at a time, huge pages still gave W1v nothing and cost W1 5% (Zen 5, 2026-12-05)."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if device.type != "cpu" or nbytes < HUGE_PAGE or not hasattr(mmap, "MAP_ANONYMOUS"):
        return torch.zeros(shape, dtype=dtype, device=device)
    return _mapped(list(shape), dtype, nbytes, huge_pages=False)


def _mapped(shape: list[int], dtype: torch.dtype, nbytes: int, *, huge_pages: bool = True) -> torch.Tensor:
    # A length in whole huge pages makes the kernel align the mapping's start to one.
    mapping = mmap.mmap(-1, -(-nbytes // HUGE_PAGE) * HUGE_PAGE,
                        flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advice = getattr(mmap, "MADV_HUGEPAGE" if huge_pages else "MADV_NOHUGEPAGE", None)
    try:
        if advice is not None:
            mapping.madvise(advice, 0, nbytes // HUGE_PAGE * HUGE_PAGE)
    except OSError:
        pass  # a kernel without transparent huge pages: small pages either way
    # The tensor holds the mapping (its buffer) for as long as it lives.
    return torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes).view(dtype).view(shape)
