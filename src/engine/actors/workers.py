"""Worker groups: the ranks that execute steps. The supervisor drives any ``WorkerGroup``;
``ProcessWorkerGroup`` is the real one (one trio-parallel worker process per rank), and
tests substitute an in-process fake so actor behaviour runs under trio's mock clock."""

from __future__ import annotations

import contextlib
import math
import os
import signal
from typing import Protocol

import trio
import trio_parallel

from engine.config import EngineArgs
from engine.worker import process
from engine.worker.protocol import StepPlan, StepResult


class WorkerCrashed(Exception):
    """A rank's process died; ``exit_code`` as the OS reported it."""

    def __init__(self, message: str, exit_code: int | None = None) -> None:
        super().__init__(message)
        self.exit_code = exit_code


@contextlib.asynccontextmanager
async def _worker_context():
    # On the way out a context reports a worker that was killed (by a fault, or by us after
    # a failed step) as BrokenWorkerError; at shutdown that is not an error.
    with contextlib.suppress(trio_parallel.BrokenWorkerError):
        async with trio_parallel.open_worker_context(idle_timeout=math.inf, grace_period=5.0) as context:
            yield context


class WorkerGroup(Protocol):
    pids: tuple[int, ...]

    async def load(self) -> process.WorkerInfo: ...

    async def execute(self, plan: StepPlan) -> StepResult: ...

    async def kill(self) -> None: ...


class ProcessWorkerGroup:
    """N trio-parallel worker contexts, each with its own CapacityLimiter(1): the default
    limiter is global and would let one rank spawn a second process."""

    def __init__(self, args: EngineArgs, model_path: str, contexts: list[trio_parallel.WorkerContext]) -> None:
        self.args = args
        self.model_path = model_path
        self._contexts = contexts
        self._limiters = [trio.CapacityLimiter(1) for _ in contexts]
        self.pids: tuple[int, ...] = ()

    @classmethod
    @contextlib.asynccontextmanager
    async def open(cls, args: EngineArgs, model_path: str):
        async with contextlib.AsyncExitStack() as stack:
            contexts = [
                await stack.enter_async_context(_worker_context())
                for _ in range(args.tensor_parallel_size)
            ]
            yield cls(args, model_path, contexts)

    async def _on_all_ranks(self, fn, *args) -> list:
        results: list = [None] * len(self._contexts)

        async def run_rank(rank: int) -> None:
            try:
                results[rank] = await self._contexts[rank].run_sync(
                    fn, *args, kill_on_cancel=True, limiter=self._limiters[rank]
                )
            except trio_parallel.BrokenWorkerError as e:
                code = getattr(e.args[-1], "exitcode", None) if e.args else None
                raise WorkerCrashed(f"rank {rank}'s worker process died (exit code {code})", code) from e

        async with trio.open_nursery() as nursery:
            for rank in range(len(self._contexts)):
                nursery.start_soon(run_rank, rank)
        return results

    async def load(self) -> process.WorkerInfo:
        threads = max(1, (os.cpu_count() or 1) // len(self._contexts))
        infos = await self._on_all_ranks(process.load, self.args, self.model_path, threads)
        self.pids = tuple(info.pid for info in infos)
        return infos[0]

    async def execute(self, plan: StepPlan) -> StepResult:
        return (await self._on_all_ranks(process.execute, plan))[0]

    def _kill_processes(self) -> None:
        for pid in self.pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.pids = ()

    async def kill(self) -> None:
        """Ends every rank (a process group cannot lose one member); the next call on each
        context starts a fresh process."""
        self._kill_processes()
        for rank, context in enumerate(self._contexts):
            # A context whose worker was killed while idle reports it on the next call;
            # take that here rather than in the reload.
            with contextlib.suppress(trio_parallel.BrokenWorkerError):
                await context.run_sync(os.getpid, limiter=self._limiters[rank])
