"""Unit test of the worker's malloc settings, in a child process so that pytest's own
allocator stays as it is."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_large_blocks_stay_resident_for_the_next_step():
    probe = textwrap.dedent("""
        import torch
        from engine.worker.host_memory import keep_freed_memory

        def resident_kib():
            with open("/proc/self/status") as status:
                return next(int(line.split()[1]) for line in status if line.startswith("VmRSS"))

        assert keep_freed_memory()
        block = torch.ones(64 * 2**20 // 4)  # 64 MiB, above glibc's largest mmap threshold
        before = resident_kib()
        del block
        print(before - resident_kib())
    """)
    done = subprocess.run([sys.executable, "-c", probe], env={"PYTHONPATH": str(SRC)},
                          capture_output=True, text=True, check=True)
    released_kib = int(done.stdout)
    assert released_kib < 1024, f"{released_kib} KiB went back to the kernel"
