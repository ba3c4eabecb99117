"""Unit tests of the worker's host memory: malloc settings (in a child process, so that
pytest's own allocator stays as it is), weights in huge pages, and the KV cache's pages
committed ahead of a step's writes."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_large_blocks_stay_resident_for_the_next_step():
    probe = textwrap.dedent("""
        import torch
        from triode.engine.worker.host_memory import keep_freed_memory

        def resident_kib():
            with open("/proc/self/status") as status:
                return next(int(line.split()[1]) for line in status if line.startswith("VmRSS"))

        assert keep_freed_memory()
        block = torch.ones(64 * 2**20 // 4)  # 64 MiB, above glibc's largest mmap threshold
        before = resident_kib()
        del block
        print(before - resident_kib())
    """)
    done = subprocess.run([sys.executable, "-c", probe], env={},
                          capture_output=True, text=True, check=True)
    released_kib = int(done.stdout)
    assert released_kib < 1024, f"{released_kib} KiB went back to the kernel"


def _mappings_of(tensor) -> list[dict[str, str]]:
    """The /proc/self/smaps entries (field -> value) that hold the tensor's bytes."""
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    entries, current = [], None
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                low, high = (int(part, 16) for part in head.split("-"))
                current = {"range": head} if low < end and high > start else None
                if current is not None:
                    entries.append(current)
            elif current is not None:
                key, _, value = line.partition(":")
                current[key] = value.strip()
    return entries


def _resident_anonymous_kib() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("RssAnon"))


def _make_weights(megabytes: float):
    import torch

    from triode.engine.worker.host_memory import weight_tensor

    tensor = weight_tensor([int(megabytes * 2**20) // 2], torch.float16)
    tensor.fill_(0.5)
    return tensor


@pytest.mark.skipif(not Path("/sys/kernel/mm/transparent_hugepage").exists(),
                    reason="a kernel with transparent huge pages")
def test_weights_ask_for_huge_pages_and_only_whole_ones():
    before = _resident_anonymous_kib()
    tensor = _make_weights(2.25)  # one whole huge page and a quarter
    resident_kib = _resident_anonymous_kib() - before
    assert tensor.shape == (int(2.25 * 2**20) // 2,) and tensor.is_contiguous()
    assert float(tensor.double().sum()) == 0.5 * tensor.numel()  # its mapping outlived the call
    mappings = _mappings_of(tensor)
    advised = [m for m in mappings if "hg" in m["VmFlags"].split()]
    assert len(advised) == 1 and advised[0]["Size"] == "2048 kB", mappings
    # The tail past the huge page is in small pages: no second huge page is made resident.
    assert resident_kib < 2304 + 1024, f"{resident_kib} KiB resident for 2304 KiB of weights"


def test_small_weights_are_ordinary_tensors():
    import torch

    from triode.engine.worker.host_memory import weight_tensor

    small = weight_tensor([3, 5], torch.float32)
    assert small.shape == (3, 5) and small.dtype == torch.float32
    small.fill_(2.0)
    assert float(small.sum()) == 30.0


def _resident_kib(tensor) -> int:
    """The tensor's resident pages (mincore: neighbouring mappings may share one smaps entry)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    assert tensor.data_ptr() % mmap.PAGESIZE == 0
    pages = -(-tensor.nbytes // mmap.PAGESIZE)
    flags = (ctypes.c_ubyte * pages)()
    assert libc.mincore(tensor.data_ptr(), tensor.nbytes, flags) == 0, ctypes.get_errno()
    return sum(flag & 1 for flag in flags) * mmap.PAGESIZE // 1024


def _lazy_cache(blocks: int = 512):
    """A KV-cache-shaped tensor in a fresh lazily mapped mapping: 12 KiB a block (6 MiB, whole
    huge pages, all advised against them even where the kernel gives them unasked)."""
    import torch

    from triode.engine.worker.host_memory import zeroed_tensor

    return zeroed_tensor((blocks, 16, 3, 64), torch.float32, torch.device("cpu"))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_POPULATE_WRITE")
def test_kv_pages_commit_the_blocks_through_the_highest_and_keep_what_they_hold():
    from triode.engine.worker.kv_pages import KVPages
    from triode.kernels.native import native_library

    if native_library() is None:
        pytest.skip("no C compiler for triode's kernels")
    k_cache, v_cache = _lazy_cache(), _lazy_cache()
    k_cache[:2] = 1.5  # blocks 0 and 1 written by a step before
    pages = KVPages([k_cache, v_cache])
    assert pages.num_blocks == 512 and pages.committed_blocks == 0
    assert _resident_kib(v_cache) == 0

    pages.commit_through(9)
    assert pages.committed_blocks == 10
    assert [_resident_kib(cache) for cache in (k_cache, v_cache)] == [120, 120]  # 10 blocks of 12 KiB
    assert float(k_cache[:2].sum()) == 1.5 * k_cache[:2].numel() and float(k_cache[2:].abs().sum()) == 0
    assert float(v_cache.abs().sum()) == 0  # committed pages read as zeros, as the lazy ones did

    pages.commit_through(4)  # already committed: nothing changes
    assert pages.committed_blocks == 10
    pages.commit_through(10_000)  # past the cache: through its last block
    assert pages.committed_blocks == 512 and _resident_kib(k_cache) == 6144


def test_kv_pages_without_the_kernel_call_leave_pages_to_fault_in(monkeypatch, caplog):
    import errno

    from triode.engine.worker import kv_pages

    calls = []

    def failing(starts, lengths, count):
        calls.append(count)
        return errno.EINVAL  # a kernel older than Linux 5.14

    monkeypatch.setattr(kv_pages, "_populate_function", lambda: failing)
    k_cache, v_cache = _lazy_cache(), _lazy_cache()
    pages = kv_pages.KVPages([k_cache, v_cache])
    with caplog.at_level("WARNING", logger=kv_pages.__name__):
        pages.commit_through(3)
        pages.commit_through(50)
    assert calls == [2] and pages.committed_blocks == 0
    assert [r.getMessage() for r in caplog.records] == [
        "KV cache pages are left to fault in as steps write them: this kernel has no MADV_POPULATE_WRITE"]

    monkeypatch.setattr(kv_pages, "_populate_function", lambda: None)  # no C kernels
    unbuilt = kv_pages.KVPages([_lazy_cache()])
    unbuilt.commit_through(3)
    assert unbuilt.committed_blocks == 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_POPULATE_WRITE")
def test_kv_pages_for_a_rank_take_every_layers_caches_on_a_cpu_only():
    import torch

    from triode.engine.worker.kv_pages import kv_pages_for
    from triode.kernels.native import native_library

    if native_library() is None:
        pytest.skip("no C compiler for triode's kernels")
    caches = [(_lazy_cache(), _lazy_cache()), (_lazy_cache(), _lazy_cache())]
    pages = kv_pages_for(caches)
    assert pages is not None and pages.num_blocks == 512
    pages.commit_through(0)
    assert [_resident_kib(cache) for pair in caches for cache in pair] == [12, 12, 12, 12]
    empty = torch.zeros((0, 16, 3, 64))
    assert kv_pages_for([(empty, empty)]) is None  # an encoder keeps no KV
    assert kv_pages_for([]) is None
    if torch.cuda.is_available():
        on_gpu = torch.zeros((4, 16, 3, 64), device="cuda")
        assert kv_pages_for([(on_gpu, on_gpu)]) is None


def test_kv_pages_refuse_caches_of_different_blocks():
    from triode.engine.worker.kv_pages import KVPages

    with pytest.raises(ValueError, match=r"differ in blocks: \[256, 512\]"):
        KVPages([_lazy_cache(), _lazy_cache(256)])
    with pytest.raises(ValueError, match="contiguous CPU"):
        KVPages([])
