"""Entry points that run inside a worker process (called through trio-parallel).

The runner lives in a module global: the process is dedicated to one rank, and every call is
a short function that finds it there. Loading is an explicit call, not trio-parallel's
``init``, so that a load error comes back to the engine as an exception with its message."""

from __future__ import annotations

import os
from pathlib import Path

import attrs
import torch

from engine.config import EngineArgs
from engine.worker.protocol import StepPlan, StepResult
from engine.worker.runner import ModelRunner

_runner: ModelRunner | None = None


@attrs.frozen(kw_only=True)
class WorkerInfo:
    """What the engine learns from a freshly loaded worker."""

    pid: int
    num_blocks: int
    block_size: int
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    dtype: str
    device: str
    load_seconds: float


def load(args: EngineArgs, model_path: str, num_threads: int | None = None) -> WorkerInfo:
    import time

    global _runner
    started = time.perf_counter()
    torch.set_num_threads(num_threads or os.cpu_count() or 1)
    _runner = None
    _runner = ModelRunner(args, Path(model_path))
    return WorkerInfo(
        pid=os.getpid(),
        num_blocks=_runner.num_blocks,
        block_size=_runner.block_size,
        max_model_len=_runner.max_model_len,
        vocab_size=_runner.config.vocab_size,
        eos_token_ids=_runner.config.eos_token_ids,
        dtype=str(_runner.dtype).removeprefix("torch."),
        device=str(_runner.device),
        load_seconds=time.perf_counter() - started,
    )


def execute(plan: StepPlan) -> StepResult:
    if _runner is None:
        raise RuntimeError("the worker has no model loaded; call load() first")
    return _runner.execute(plan)
