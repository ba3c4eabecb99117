"""Entry points that run inside a worker process (called through trio-parallel).

The runner lives in a module global: the process is dedicated to one rank, and every call is
a short function that finds it there. Loading is an explicit call, not trio-parallel's
``init``, so that a load error comes back to the engine as an exception with its message.

Tensor parallelism takes two calls: ``serve_rendezvous`` on rank 0 (its TCPStore binds the
port, a free one unless MASTER_PORT names it, and stays in this process), then ``load`` on
every rank at once with the port it returned; the ranks join the process group there. With
followers on other nodes, rank 0 also announces the group to them and forwards every plan
(``triode.engine.worker.follower``)."""

from __future__ import annotations

import atexit
import gc
import os
import sys
import time
from pathlib import Path

import torch

from triode.engine.config import EngineArgs
from triode.engine.cpus import usable_cpus
from triode.engine.tensor_parallel import Rendezvous
from triode.engine.worker import step_server
from triode.engine.worker.distributed import peak_resident_bytes
from triode.engine.worker.faults import Fault, inject, parse_fault_plan
from triode.engine.worker.host_memory import keep_freed_memory
from triode.engine.worker.rendezvous import PlanFeed, announce, serve_store
from triode.engine.worker.runner import ModelRunner
from triode.engine.worker_messages import StepPlan, StepResult, WorkerInfo

_runner: ModelRunner | None = None
_store = None  # rank 0's rendezvous server, kept until the next load
_feed: PlanFeed | None = None  # rank 0 with followers on other nodes: their plans
_faults: tuple[Fault, ...] = ()  # the engine's TRIODE_FAULT_PLAN (tests and scenarios only)


def _end_without_collecting() -> None:
    # At exit the interpreter runs the cycle collector over every object torch, triton and
    # the model made (about a second and a half each time a worker stops) only to free
    # memory the process is about to give back. Frozen objects are skipped; what that
    # leaves uncollected libtriton's nanobind reports as leaks on stderr at teardown, the
    # same report triton silences in its own compile workers. Errors before this point
    # (a job's traceback, multiprocessing's) are already written.
    gc.freeze()
    sys.stdout.flush()
    sys.stderr.flush()
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    os.close(devnull)


def serve_rendezvous(host: str, port: int | None, timeout_s: float) -> int:
    """Rank 0: serves the rendezvous store on ``port`` (None: a free one) and returns it."""
    global _store
    _store = None
    _store = serve_store(host, port, timeout_s)
    return _store.port


def load(
    args: EngineArgs,
    model_path: str,
    fault_plan: str | None,
    num_threads: int | None = None,
    rank: int = 0,
    rendezvous: Rendezvous | None = None,
) -> WorkerInfo:
    global _runner, _feed, _faults
    started = time.perf_counter()
    baseline = peak_resident_bytes()
    torch.set_num_threads(num_threads or usable_cpus())
    atexit.unregister(_end_without_collecting)  # once, however often the process loads
    atexit.register(_end_without_collecting)
    keep_freed_memory()
    if _runner is not None:
        _runner.close()
    _runner = _feed = None
    _faults = parse_fault_plan(fault_plan)
    store = _store if rendezvous is not None and rank == 0 else None
    if store is not None and rendezvous.has_followers:
        _feed = PlanFeed(store, announce(store, args, rendezvous))
    _runner = ModelRunner(args, Path(model_path), rank=rank, rendezvous=rendezvous, store=store)
    return WorkerInfo(
        pid=os.getpid(),
        num_blocks=_runner.num_blocks,
        kv_cache_memory_bytes=_runner.kv_cache_memory,
        kv_cache_sizing=_runner.kv_cache_sizing,
        block_size=_runner.block_size,
        max_model_len=_runner.max_model_len,
        vocab_size=_runner.config.vocab_size,
        dtype=str(_runner.dtype).removeprefix("torch."),
        device=str(_runner.device),
        load_seconds=time.perf_counter() - started,
        rank=rank,
        tensor_parallel_size=rendezvous.world_size if rendezvous is not None else 1,
        kv_heads=_runner.kv_caches[0][0].shape[2],
        kv_window=_runner.config.kv_window,
        runner=_runner.runner,
        hidden_size=_runner.config.hidden_size,
        whole_prompts=_runner.config.encoder,
        baseline_rss_bytes=baseline,
        weights_peak_rss_bytes=_runner.weights_peak_rss_bytes,
        peak_rss_bytes=peak_resident_bytes(),
    )


def serve_steps(address: str, token: bytes) -> None:
    """Runs the plans the engine sends over its step channel, until the engine closes it (the
    one long call this process runs once loaded; triode.engine.worker.step_server)."""
    step_server.serve(address, token, execute)


def execute(plan: StepPlan) -> StepResult:
    if _runner is None:
        raise RuntimeError("the worker has no model loaded; call load() first")
    if _faults:  # every rank the engine runs inflicts it
        inject(_faults, plan.step_id)
    if _feed is None:
        return _runner.execute(plan)
    _feed.publish(plan)
    result = _runner.execute(plan)
    if plan.chunks:  # the step's collectives prove that every follower has read its plans
        _feed.settle()
    return result
