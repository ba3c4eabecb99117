"""The real worker group (``actors.worker_group.WorkerGroup``): ``ProcessWorkerGroup``, the
ranks that execute steps, one trio-parallel worker process per rank.

A group loads its ranks with trio-parallel calls, then keeps each rank's step channel open
(``actors/step_channel.py``): ``submit`` sends a plan to every rank at once, in call order, and
never waits, so a plan made ahead reaches the workers while the step before it runs.

With ``tensor_parallel_size`` N > 1 the N ranks form one ``torch.distributed`` process group:
rank 0 serves the rendezvous (a TCPStore on a free loopback port, or on MASTER_ADDR /
MASTER_PORT when set), then every rank loads its shard and joins. A bad size or a taken
port fails in ``open`` before any process is spawned. One rank failing fails the step at
once (the others are cancelled, which kills their processes: a rank blocked in a collective
would otherwise wait for its dead peer), and ``kill`` ends every rank."""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import attrs
import trio
import trio_parallel

from triode.engine.actors.step_channel import (
    PendingStep,
    StepChannel,
    accept_worker,
    encode_plan,
    new_token,
    open_listener,
)
from triode.engine.actors.worker_group import StepTicket, WorkerCrashed, rank0_result
from triode.engine.actors.worker_spawn import open_worker_context, starting_engine_workers
from triode.engine.config import EngineArgs
from triode.engine.cpus import usable_cpus
from triode.engine.tensor_parallel import (
    Rendezvous,
    check_before_spawn,
    local_rank_count,
    rendezvous_address,
)
from triode.engine.worker import calls
from triode.engine.worker.faults import fault_plan_from_env
from triode.engine.worker_messages import StepPlan, WorkerInfo

_CONNECT_SECONDS = 60.0  # from a loaded worker's serving call to its step channel
_CLOSE_SECONDS = 5.0


async def _first_of(accepting: Awaitable[trio.SocketStream], died: Awaitable[None]) -> trio.SocketStream | None:
    """The accepted stream, or None if the worker's call ended first."""
    outcome: list[trio.SocketStream | None] = []

    async def run(awaitable: Awaitable[trio.SocketStream | None], cancel_scope: trio.CancelScope) -> None:
        value = await awaitable
        if not outcome:
            outcome.append(value)
        cancel_scope.cancel()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run, accepting, nursery.cancel_scope)
        nursery.start_soon(run, died, nursery.cancel_scope)
    return outcome[0] if outcome and isinstance(outcome[0], trio.SocketStream) else None


class ProcessWorkerGroup:
    """N trio-parallel worker contexts, each with its own CapacityLimiter(1): the default
    limiter is global and would let one rank spawn a second process."""

    def __init__(self, args: EngineArgs, model_path: str, fault_plan: str | None,
                 contexts: list[trio_parallel.WorkerContext], listeners: list[tuple[str, trio.socket.SocketType]],
                 nursery: trio.Nursery) -> None:
        self.args = args
        self.model_path = model_path
        self.fault_plan = fault_plan  # tests' and scenarios' (triode.engine.worker.faults)
        self._contexts = contexts
        self._limiters = [trio.CapacityLimiter(1) for _ in contexts]
        self._listeners = listeners  # (address, socket) per rank, for its step channel
        self._nursery = nursery
        self._channels: list[StepChannel] = []
        self._encode_seconds = 0.0
        self._retired_decode_seconds = 0.0  # of the channels of earlier loads
        self._serving: trio.CancelScope | None = None
        self._served = trio.Event()
        self._served.set()
        self.pids: tuple[int, ...] = ()
        self.infos: tuple[WorkerInfo, ...] = ()  # every rank's, from the last load

    @classmethod
    @contextlib.asynccontextmanager
    async def open(cls, args: EngineArgs, model_path: str) -> AsyncIterator[ProcessWorkerGroup]:
        await trio.to_thread.run_sync(check_before_spawn, args, model_path)
        fault_plan = fault_plan_from_env()
        async with contextlib.AsyncExitStack() as stack:
            # Ranks past TRIODE_TP_LOCAL_RANKS run on other nodes (followers), not here.
            local = local_rank_count(args.tensor_parallel_size)
            contexts = [await stack.enter_async_context(open_worker_context()) for _ in range(local)]
            listeners = [await stack.enter_async_context(open_listener()) for _ in range(local)]
            nursery = await stack.enter_async_context(trio.open_nursery())
            group = cls(args, model_path, fault_plan, contexts, listeners, nursery)
            try:
                yield group
            finally:
                with trio.move_on_after(_CLOSE_SECONDS, shield=True):
                    await group._stop_serving()
                if group._serving is not None:
                    group._serving.cancel()

    async def _run_on(self, rank: int, fn: Callable[..., Any], *args: Any, kill_on_cancel: bool = False) -> Any:
        # Any call may start the rank's process (the first, and the first after a kill).
        with starting_engine_workers():
            return await self._contexts[rank].run_sync(
                fn, *args, kill_on_cancel=kill_on_cancel, limiter=self._limiters[rank]
            )

    async def _on_ranks(self, ranks: range,
                        call: Callable[[int], tuple[Callable[..., Any], tuple[Any, ...]]]) -> list[Any]:
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
        threads = max(1, usable_cpus() // local)
        if size == 1:
            # One rank: no process group at all.
            infos = await self._on_ranks(
                range(1), lambda rank: (calls.LOAD, (self.args, self.model_path, self.fault_plan, threads))
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
                lambda rank: (calls.LOAD, (self.args, self.model_path, self.fault_plan, threads, rank,
                                           rendezvous)),
            )
        self.infos = tuple(infos)
        self.pids = tuple(info.pid for info in infos)
        if self.args.kv_cache_memory is None:
            # A restart gets the blocks the scheduler knows, whatever memory is free by then.
            self.args = attrs.evolve(self.args, kv_cache_memory=infos[0].kv_cache_memory_bytes)
        await self._start_serving()
        return self.infos[0]

    def submit(self, plan: StepPlan) -> StepTicket:
        """Sends ``plan`` to every rank now (after the plans submitted before it)."""
        if not self._channels:
            pending = PendingStep()
            pending._settle(error=WorkerCrashed("the workers are not loaded", None))
            return functools.partial(rank0_result, [pending])
        started = time.perf_counter()
        frame = encode_plan(plan)  # once, whatever the number of ranks
        self._encode_seconds += time.perf_counter() - started
        return functools.partial(rank0_result, [channel.send_frame(frame) for channel in self._channels])

    @property
    def encode_seconds(self) -> float:
        """Seconds spent pickling plans."""
        return self._encode_seconds

    @property
    def decode_seconds(self) -> float:
        """Seconds spent unpickling results, over every load."""
        return self._retired_decode_seconds + sum(channel.decode_seconds for channel in self._channels)

    async def _start_serving(self) -> None:
        """Each rank's one long call: run the plans of its step channel (calls.SERVE_STEPS)."""
        # Shielded: an engine that is cancelled closes the channels (open's cleanup), so the
        # workers finish their loop and exit as they would idle; kill() cancels it.
        self._serving = serving = trio.CancelScope(shield=True)
        self._served = trio.Event()
        done = [trio.Event() for _ in self._contexts]

        async def serve_all(task_status: trio.TaskStatus[list[StepChannel]] = trio.TASK_STATUS_IGNORED) -> None:
            try:
                with serving:
                    async with trio.open_nursery() as nursery:
                        channels = [await nursery.start(self._serve_rank, rank, done[rank])
                                    for rank in range(len(self._contexts))]
                        task_status.started(channels)
            finally:
                self._served.set()

        self._retired_decode_seconds += sum(channel.decode_seconds for channel in self._channels)
        self._channels = await self._nursery.start(serve_all)

    async def _serve_rank(self, rank: int, done: trio.Event,
                          task_status: trio.TaskStatus[StepChannel] = trio.TASK_STATUS_IGNORED) -> None:
        address, listener = self._listeners[rank]
        token = new_token()
        crash: list[WorkerCrashed] = []

        async def run_call() -> None:
            try:
                await self._run_on(rank, calls.SERVE_STEPS, address, token, kill_on_cancel=True)
            except trio_parallel.BrokenWorkerError as e:
                code = getattr(e.args[-1], "exitcode", None) if e.args else None
                crash.append(WorkerCrashed(f"rank {rank}'s worker process died (exit code {code})", code))
            except Exception as e:
                crash.append(WorkerCrashed(f"rank {rank}'s step channel failed: {type(e).__name__}: {e}"))
            finally:
                done.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run_call)
            with trio.move_on_after(_CONNECT_SECONDS) as connecting:
                stream = await _first_of(accept_worker(listener, token), done.wait())
            if connecting.cancelled_caught or stream is None:
                raise crash[0] if crash else WorkerCrashed(f"rank {rank}'s worker did not open its step channel")
            channel = StepChannel(stream)
            task_status.started(channel)
            await channel.run()
            # The worker's end closed: it died, or stopped after we closed ours. trio-parallel
            # says which, with the exit code, a moment later.
            with trio.move_on_after(_CLOSE_SECONDS):
                await done.wait()
            channel.fail_pending(crash[0] if crash else WorkerCrashed(f"rank {rank}'s step channel closed"))
            nursery.cancel_scope.cancel()

    async def _stop_serving(self) -> None:
        """Closes the step channels (each worker's loop then ends) and waits for the calls."""
        for channel in self._channels:
            channel.close()
        await self._served.wait()

    def _kill_processes(self) -> None:
        for pid in self.pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.pids = ()

    async def kill(self) -> None:
        """Ends every rank (a process group cannot lose one member); the next call on each
        context starts a fresh process. Plans without a reply fail."""
        self._kill_processes()
        for channel in self._channels:
            channel.fail_pending(WorkerCrashed("the worker group was restarted"))
            self._retired_decode_seconds += channel.decode_seconds
        self._channels = []
        if self._serving is not None:
            self._serving.cancel()
        await self._served.wait()
        for rank in range(len(self._contexts)):
            # A context whose worker was killed while idle reports it on the next call;
            # take that here rather than in the reload.
            with contextlib.suppress(trio_parallel.BrokenWorkerError):
                await self._run_on(rank, os.getpid)
