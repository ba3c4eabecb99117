"""Worker groups: the ranks that execute steps. The supervisor drives any ``WorkerGroup``;
``ProcessWorkerGroup`` is the real one (one trio-parallel worker process per rank), and
tests substitute an in-process fake so actor behaviour runs under trio's mock clock.

With ``tensor_parallel_size`` N > 1 the N ranks form one ``torch.distributed`` process group:
rank 0 serves the rendezvous (a TCPStore on a free loopback port, or on MASTER_ADDR /
MASTER_PORT when set), then every rank loads its shard and joins. A bad size or a taken
port fails in ``open`` before any process is spawned. Every step goes to every rank; rank 0's
result comes back, carrying each rank's step and collective times. One rank failing fails
the step at once (the others are cancelled, which kills their processes: a rank blocked in
a collective would otherwise wait for its dead peer), and ``kill`` ends every rank."""

from __future__ import annotations

import contextlib
import math
import os
import signal
from collections.abc import Callable
from typing import Any, Protocol

import attrs
import trio
import trio_parallel

from engine.actors.worker_spawn import starting_engine_workers
from engine.config import EngineArgs
from engine.model_config import ModelConfig
from engine.model_files.layout import load_hf_config
from engine.tensor_parallel import (
    Rendezvous,
    check_port_free,
    check_tensor_parallel,
    local_rank_count,
    rendezvous_address,
)
from engine.worker import calls
from engine.worker_messages import StepPlan, StepResult, WorkerInfo


class WorkerCrashed(Exception):
    """A rank's process died; ``exit_code`` as the OS reported it."""

    def __init__(self, message: str, exit_code: int | None = None) -> None:
        super().__init__(message)
        self.exit_code = exit_code


# Worker processes inherit this at spawn (torch's libgomp reads it when torch loads). By
# default an OpenMP thread spins about 300k times at every barrier before it sleeps; when the
# worker shares its cores with the server, the engine, a client or another rank, the spinning
# thread burns the time slice the thread it waits for needs. Measured on 2 cores, 64 decodes
# per step: quiet, 302 ms default, 275 ms at 2000 spins, 340 ms passive (no spinning); with
# one core kept busy by another process, 1216 ms default, 640 ms at 2000 spins, 520 passive.
# 2000 spins keep the quiet speed and halve the loss when shared. A user's setting wins.
WORKER_ENVIRONMENT = {"GOMP_SPINCOUNT": "2000"}


@contextlib.asynccontextmanager
async def _worker_context():
    for name, value in WORKER_ENVIRONMENT.items():
        os.environ.setdefault(name, value)
    # On the way out a context reports a worker that was killed (by a fault, or by us after
    # a failed step) as BrokenWorkerError; at shutdown that is not an error.
    with contextlib.suppress(trio_parallel.BrokenWorkerError):
        async with trio_parallel.open_worker_context(idle_timeout=math.inf, grace_period=5.0) as context:
            yield context


class WorkerGroup(Protocol):
    pids: tuple[int, ...]

    async def load(self) -> WorkerInfo: ...

    async def execute(self, plan: StepPlan) -> StepResult: ...

    async def kill(self) -> None: ...


def check_before_spawn(args: EngineArgs, model_path: str) -> None:
    """The start-up checks of a tensor-parallel group that need no worker: the size against
    the model's heads (and the CUDA devices), and a MASTER_PORT that must be free."""
    if args.tensor_parallel_size == 1:
        return
    config = ModelConfig.from_hf(load_hf_config(model_path), source=f"{model_path}/config.json")
    check_tensor_parallel(
        config, args.tensor_parallel_size, device=args.device,
        local_ranks=local_rank_count(args.tensor_parallel_size),
    )
    _, port = rendezvous_address()
    if port is not None:
        check_port_free(port)


class ProcessWorkerGroup:
    """N trio-parallel worker contexts, each with its own CapacityLimiter(1): the default
    limiter is global and would let one rank spawn a second process."""

    def __init__(self, args: EngineArgs, model_path: str, contexts: list[trio_parallel.WorkerContext]) -> None:
        self.args = args
        self.model_path = model_path
        self._contexts = contexts
        self._limiters = [trio.CapacityLimiter(1) for _ in contexts]
        self.pids: tuple[int, ...] = ()
        self.infos: tuple[WorkerInfo, ...] = ()  # every rank's, from the last load

    @classmethod
    @contextlib.asynccontextmanager
    async def open(cls, args: EngineArgs, model_path: str):
        await trio.to_thread.run_sync(check_before_spawn, args, model_path)
        async with contextlib.AsyncExitStack() as stack:
            # Ranks past TRIODE_TP_LOCAL_RANKS run on other nodes (followers), not here.
            local = local_rank_count(args.tensor_parallel_size)
            contexts = [await stack.enter_async_context(_worker_context()) for _ in range(local)]
            yield cls(args, model_path, contexts)

    async def _run_on(self, rank: int, fn: Callable, *args: Any, kill_on_cancel: bool = False) -> Any:
        # Any call may start the rank's process (the first, and the first after a kill).
        with starting_engine_workers():
            return await self._contexts[rank].run_sync(
                fn, *args, kill_on_cancel=kill_on_cancel, limiter=self._limiters[rank]
            )

    async def _on_ranks(self, ranks: range, call: Callable[[int], tuple[Callable, tuple]]) -> list:
        """Runs ``fn(*args)`` from ``call(rank)`` on each rank at once. The first failure
        cancels (and so kills) the other ranks; a crash is reported before the errors it
        causes on its peers (a collective whose peer died)."""
        results: list[Any] = [None] * len(self._contexts)
        errors: list[tuple[int, Exception]] = []

        async def run_rank(rank: int, cancel_scope: trio.CancelScope) -> None:
            fn, fn_args = call(rank)
            try:
                results[rank] = await self._run_on(rank, fn, *fn_args, kill_on_cancel=True)
            except trio_parallel.BrokenWorkerError as e:
                code = getattr(e.args[-1], "exitcode", None) if e.args else None
                crash = WorkerCrashed(f"rank {rank}'s worker process died (exit code {code})", code)
                crash.__cause__ = e
                errors.append((rank, crash))
                cancel_scope.cancel()
            except Exception as e:
                errors.append((rank, e))
                cancel_scope.cancel()

        async with trio.open_nursery() as nursery:
            for rank in ranks:
                nursery.start_soon(run_rank, rank, nursery.cancel_scope)
        if errors:
            crashes = [(rank, e) for rank, e in errors if isinstance(e, WorkerCrashed)]
            _, error = min(crashes or errors, key=lambda entry: entry[0])
            raise error
        return [results[rank] for rank in ranks]

    async def load(self) -> WorkerInfo:
        size = self.args.tensor_parallel_size
        local = len(self._contexts)
        threads = max(1, (os.cpu_count() or 1) // local)
        if size == 1:
            # One rank: no process group at all.
            infos = await self._on_ranks(
                range(1), lambda rank: (calls.LOAD, (self.args, self.model_path, threads))
            )
        else:
            host, port = rendezvous_address()
            timeout = max(120.0, 2 * self.args.step_timeout)
            (port,) = await self._on_ranks(
                range(1), lambda rank: (calls.SERVE_RENDEZVOUS, (host, port, timeout))
            )
            rendezvous = Rendezvous(
                host=host, port=port, world_size=size, timeout_s=timeout, local_ranks=local
            )
            infos = await self._on_ranks(
                range(local),
                lambda rank: (calls.LOAD, (self.args, self.model_path, threads, rank, rendezvous)),
            )
        self.infos = tuple(infos)
        self.pids = tuple(info.pid for info in infos)
        return infos[0]

    async def execute(self, plan: StepPlan) -> StepResult:
        results = await self._on_ranks(range(len(self._contexts)), lambda rank: (calls.EXECUTE, (plan,)))
        if len(results) == 1:
            return results[0]
        return attrs.evolve(
            results[0],
            rank_execute_seconds=tuple(r.execute_seconds for r in results),
            rank_collective_seconds=tuple(r.collective_seconds for r in results),
        )

    def _kill_processes(self) -> None:
        for pid in self.pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.pids = ()

    async def kill(self) -> None:
        """Ends every rank (a process group cannot lose one member); the next call on each
        context starts a fresh process."""
        self._kill_processes()
        for rank in range(len(self._contexts)):
            # A context whose worker was killed while idle reports it on the next call;
            # take that here rather than in the reload.
            with contextlib.suppress(trio_parallel.BrokenWorkerError):
                await self._run_on(rank, os.getpid)
