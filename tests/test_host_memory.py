"""Unit tests of the worker's host memory: malloc settings (in a child process, so that
pytest's own allocator stays as it is) and weights in huge pages."""

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
