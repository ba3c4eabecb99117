"""Decode attention for CPUs that reads the paged KV cache in place (``csrc/paged_decode.c``).

The torch reference gathers every sequence's blocks into a padded copy before its fused
attention call; on a CPU that copy and the padded math were half of a large decode step. This
kernel walks each sequence's block table instead, one sequence per OpenMP task.

The C source is compiled on first use with the system C compiler (``$CC``, else ``cc``) for
this CPU (``-march=native``) into ``<cache>/kernels/``, keyed by a hash of the source, the
flags and the compiler, so a worker start after the first costs a ``dlopen``. Without a
compiler (or if the build fails) :func:`cpu_decode_available` is False, the reason is logged
once, and decode attention takes the torch reference. The library links the ``libgomp.so.1``
that torch has already loaded, so both share one OpenMP thread pool (``torch.set_num_threads``
governs both).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import subprocess
import tempfile
from pathlib import Path

import torch

_SOURCE = Path(__file__).parent / "csrc" / "paged_decode.c"
# -ffast-math lets the dot products vectorize; it is given to the compile step only, since
# linking a shared library with it would set flush-to-zero for the whole process (gcc < 13).
_COMPILE_FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-std=c11")
_LINK_FLAGS = ("-shared", "-fopenmp", "-lm")
_ENTRY_POINTS = {torch.float32: "triode_paged_decode_f32", torch.bfloat16: "triode_paged_decode_bf16"}
MAX_HEADS, MAX_HEAD_DIM, MAX_BLOCK_SIZE = 64, 256, 64  # as in the C source

logger = logging.getLogger(__name__)

__all__ = ["cpu_decode_available", "cpu_decode_supports", "paged_decode_cpu"]


def _cache_dir() -> Path:
    root = os.environ.get("TRIODE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "triode")
    return Path(root) / "kernels"


def _compiler() -> str:
    return os.environ.get("CC") or "cc"


def _build(compiler: str) -> Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256(
        "\0".join([_SOURCE.read_text(), *_COMPILE_FLAGS, *_LINK_FLAGS, version]).encode()
    ).hexdigest()[:16]
    library = _cache_dir() / f"paged_decode-{key}.so"
    if library.exists():
        return library
    library.parent.mkdir(parents=True, exist_ok=True)
    # Built in a private directory and renamed into place: concurrent workers never load a
    # half-written library.
    with tempfile.TemporaryDirectory(dir=library.parent) as scratch:
        obj, built = Path(scratch) / "paged_decode.o", Path(scratch) / library.name
        for command in ([compiler, *_COMPILE_FLAGS, "-c", str(_SOURCE), "-o", str(obj)],
                        [compiler, str(obj), *_LINK_FLAGS, "-o", str(built)]):
            result = subprocess.run(command, capture_output=True, text=True)
            if result.returncode:
                raise RuntimeError(f"{' '.join(command)} failed: {result.stderr.strip()[-2000:]}")
        os.replace(built, library)
    return library


@functools.cache
def _library() -> ctypes.CDLL | None:
    try:
        library = ctypes.CDLL(str(_build(_compiler())))
    except (OSError, RuntimeError, subprocess.CalledProcessError) as error:
        logger.warning("CPU decode-attention kernel unavailable, using the torch reference: %s", error)
        return None
    for name in _ENTRY_POINTS.values():
        entry = getattr(library, name)
        entry.restype = ctypes.c_int
        entry.argtypes = [
            ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
            ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
            ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
            ctypes.c_int, ctypes.c_float,
        ]
    return library


def cpu_decode_available() -> bool:
    """Whether the kernel is built and loaded (builds it on the first call)."""
    return _library() is not None


def cpu_decode_supports(query: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether these tensors fit the kernel: CPU, float32 or bfloat16, heads, head dim and block
    size within the C source's limits, and row layouts it can stride over."""
    _, block_size, kv_heads, head_dim = k_cache.shape
    return (
        query.device.type == "cpu"
        and query.dtype in _ENTRY_POINTS
        and head_dim <= MAX_HEAD_DIM
        and block_size <= MAX_BLOCK_SIZE
        and query.shape[1] <= MAX_HEADS
        and query.shape[1] % kv_heads == 0
        and query.stride(2) == 1
        and query.stride(1) == head_dim
        and cpu_decode_available()
    )


def paged_decode_cpu(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
) -> None:
    """Writes into ``out`` [seqs, heads, dim] the attention of query [seqs, heads, dim] (one
    token per sequence) over each sequence's ``seq_lens[i]`` cached tokens. The caller checks
    the metadata (block ids within the cache, lengths within each table): the kernel trusts it."""
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, kv_heads, _ = k_cache.shape
    if not (k_cache.is_contiguous() and v_cache.is_contiguous() and block_tables.is_contiguous()
            and seq_lens.is_contiguous() and out.stride(2) == 1 and out.stride(1) == head_dim):
        raise ValueError("paged_decode_cpu: caches, block tables, seq_lens and out rows must be contiguous")
    entry = getattr(_library(), _ENTRY_POINTS[query.dtype])
    status = entry(
        query.data_ptr(), query.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
        block_tables.data_ptr(), block_tables.stride(0), seq_lens.data_ptr(), out.data_ptr(),
        out.stride(0), num_seqs, num_heads, kv_heads, head_dim, block_size, scale,
    )
    if status == -2:
        raise MemoryError("paged_decode_cpu: no memory for the per-thread scratch")
    if status:
        raise ValueError(f"paged_decode_cpu: unsupported shape (heads {num_heads}, kv heads {kv_heads}, "
                         f"dim {head_dim}, block size {block_size})")
