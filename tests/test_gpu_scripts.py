"""Contract tests: the two GPU check scripts run here in their CPU modes, so that they still
work on the day a GPU is lent. scripts/gpu_check.py runs every kernel case at tiny sizes under
triton's interpreter; scripts/gpu_model_check.py runs the runner and the whole engine on the
CPU against Hugging Face by the same rules it applies on a GPU."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.tiny_models import ARCHITECTURES

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.contract


def run_script(name: str, *args: str) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, str(ROOT / "scripts" / name), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_gpu_check_dry_run_passes_every_case():
    result = run_script("gpu_check.py", "--dry-run-cpu")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "FAIL" not in result.stdout
    assert "19/19 cases ok" in result.stdout
    assert "invariant linear" in result.stdout and "0 of 19 rows differ from their decode alone" in result.stdout


@pytest.mark.slow  # the GPU script's every check on the CPU: half a minute
def test_gpu_model_check_on_cpu_passes_every_check():
    result = run_script("gpu_model_check.py", "--device", "cpu")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    ok = [line for line in result.stdout.splitlines() if line.strip().startswith("ok")]
    # the runner on every tiny architecture, decode graphs on two, the engine, pooling on two
    checks = len(ARCHITECTURES) + 5
    assert len(ok) == checks, result.stdout
    assert f"{checks}/{checks} checks ok" in result.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_gpu_model_check_without_cuda_says_so():
    result = run_script("gpu_model_check.py")
    assert result.returncode == 2
    assert "no CUDA device" in result.stderr
