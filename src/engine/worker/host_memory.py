"""Keeps freed host memory in the worker's heap instead of returning it to the kernel.

glibc serves allocations above its mmap threshold (at most 32 MiB) with a fresh ``mmap`` and
unmaps them on free. A step allocates many such tensors (gathered KV, prefill activations),
so every step paid for page faults on memory it had just released: measured here, gathering
53 MB of KV blocks took 23 ms into fresh memory and 3.5 ms into reused memory. A worker is a
dedicated process whose working set repeats every step, so it turns both off; its resident
size then stays at its peak, which is what it needs every step anyway."""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

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
