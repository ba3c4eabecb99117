"""The worker-supervisor actor: owns the worker group, runs each step under a watchdog, and
restarts the group within a budget.

A driver ``submit``s plans in plan order (the group sends each at once, so one made ahead waits
on the workers while the step before it runs) and awaits each ticket it gets back in the same
order. A failed step (a rank died, hung past ``step_timeout``, or raised) restarts the
whole group (every rank: a process group cannot lose one member; the reload forms a new group
on a new rendezvous) and raises ``WorkerFailure``, whose running requests are then recomputed;
the steps submitted after it were lost with the old workers and raise ``WorkerFailure`` too,
without a second restart. More than ``restart_budget`` failures within ``restart_window``
seconds fail the engine with ``EngineDeadError``, for that step and every later one.
``statistics()`` reports each rank's step and collective times (rank order; the ranks this
engine runs, not followers on other nodes).
"""

from __future__ import annotations

import collections
import functools
import time
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager

import attrs
import trio

from triode.engine.actors.step_channel import StepRaised
from triode.engine.actors.worker_group import StepTicket, WorkerCrashed, WorkerGroup
from triode.engine.actors.workers import ProcessWorkerGroup
from triode.engine.config import EngineArgs
from triode.engine.errors import (
    EngineDeadError,
    ModelLoadError,
    StepTimeout,
    TriodeError,
    WorkerFailure,
)
from triode.engine.worker_messages import StepPlan, StepResult, WorkerInfo

GroupOpener = Callable[[], AbstractAsyncContextManager[WorkerGroup]]


@attrs.frozen(kw_only=True)
class SupervisorStatistics:
    worker_pids: tuple[int, ...]  # rank order
    worker_restarts: int
    steps: int
    step_seconds_total: float
    last_failure: str | None
    tensor_parallel_size: int = 1
    # Per rank, in rank order: the step time measured inside each worker (its execute) and,
    # of that, the time in tensor-parallel collectives (all-reduce, logits gather); totals
    # over the engine's life and the last step's.
    rank_step_seconds_total: tuple[float, ...] = ()
    rank_collective_seconds_total: tuple[float, ...] = ()
    rank_last_step_seconds: tuple[float, ...] = ()
    rank_last_collective_seconds: tuple[float, ...] = ()
    rank_peak_rss_bytes: tuple[int | None, ...] = ()  # each rank's peak RSS after its load
    grammar_seconds_total: float = 0.0  # of rank 0's step time, following structured outputs
    prepare_seconds_total: float = 0.0  # of rank 0's step time, host work around the forward
    forward_seconds_total: float = 0.0  # of rank 0's step time, the model's forward
    sample_seconds_total: float = 0.0  # of rank 0's step time, sampling
    # in the engine process: pickling plans, and unpickling results (part of step_seconds_total)
    encode_seconds_total: float = 0.0
    decode_seconds_total: float = 0.0


class WorkerSupervisor:
    def __init__(
        self,
        args: EngineArgs,
        model_path: str,
        *,
        restart_budget: int = 3,
        restart_window: float = 60.0,
        open_group: GroupOpener | None = None,
    ) -> None:
        self.args = args
        self.restart_budget = restart_budget
        self.restart_window = restart_window
        self._model_path = model_path
        self._open_group = open_group or (lambda: ProcessWorkerGroup.open(args, model_path))
        self._group: WorkerGroup | None = None
        self._failures: collections.deque[float] = collections.deque()
        self.info: WorkerInfo | None = None
        self._restarts = 0
        self.restarting = False  # between a failed step and the reloaded group
        self._steps = 0
        self._step_seconds = 0.0
        self._last_failure: str | None = None
        size = args.tensor_parallel_size
        self._rank_seconds = [0.0] * size
        self._rank_collective = [0.0] * size
        self._rank_last: tuple[float, ...] = (0.0,) * size
        self._rank_last_collective: tuple[float, ...] = (0.0,) * size
        self._grammar_seconds = 0.0
        self._prepare_seconds = 0.0
        self._forward_seconds = 0.0
        self._sample_seconds = 0.0
        self._generation = 0  # restarts so far: a step carries the one it was sent to
        self._last_done = 0.0  # when the last step's result came in
        self._dead: EngineDeadError | None = None
        self._restarted = trio.Event()  # set while no restart runs
        self._restarted.set()

    async def run(self, *, task_status: trio.TaskStatus[WorkerSupervisor] = trio.TASK_STATUS_IGNORED) -> None:
        async with self._open_group() as group:
            self._group = group
            try:
                self.info = await group.load()
            except (TriodeError, WorkerCrashed):
                raise
            except Exception as e:  # the worker's own: a torch allocation, a file it could not parse
                raise ModelLoadError(f"the workers could not load the model: {type(e).__name__}: {e}",
                                     path=self._model_path) from e
            task_status.started(self)
            await trio.sleep_forever()

    def submit(self, plan: StepPlan) -> StepTicket:
        """Sends the plan to every rank now, after those submitted before it; awaiting the
        ticket (in submission order) gives its result, run under the watchdog."""
        return functools.partial(self._supervise, plan, self._workers.submit(plan), self._generation,
                                 trio.current_time())

    @property
    def _workers(self) -> WorkerGroup:
        if self._group is None:
            raise EngineDeadError("the workers were never started (run the supervisor first)")
        return self._group

    async def _supervise(self, plan: StepPlan, ticket: StepTicket, generation: int, submitted: float) -> StepResult:
        if self._dead is not None:
            raise EngineDeadError(str(self._dead)) from self._dead
        if generation != self._generation:
            raise WorkerFailure(f"step {plan.step_id} was not run: the workers it was sent to were restarted "
                                f"after a step before it failed ({self._last_failure})")
        failure: WorkerFailure | None = None
        cause: BaseExceptionGroup[Exception] | None = None
        try:
            with trio.fail_after(self.args.step_timeout):
                result = await ticket()
        except* trio.TooSlowError as group:
            failure, cause = StepTimeout(
                f"step {plan.step_id} ran past step_timeout={self.args.step_timeout}s"
            ), group
        except* WorkerCrashed as group:
            failure, cause = WorkerFailure(f"step {plan.step_id}: {group.exceptions[0]}"), group
        except* StepRaised as group:
            raised = group.exceptions[0]
            kind = raised.remote_type if isinstance(raised, StepRaised) else type(raised).__name__
            failure, cause = WorkerFailure(f"step {plan.step_id} raised {kind}: {raised}"), group
        except* Exception as group:
            first = group.exceptions[0]
            failure, cause = WorkerFailure(
                f"step {plan.step_id} raised {type(first).__name__}: {first}"
            ), group
        if failure is not None and cause is not None:  # set together
            if generation != self._generation or self.restarting:
                # A step before it failed (or one beside it, whose result was awaited first)
                # and restarts the workers: this one was lost with them.
                await self._restarted.wait()
                if self._dead is not None:
                    raise EngineDeadError(str(self._dead)) from self._dead
                raise WorkerFailure(f"step {plan.step_id} was lost with the workers restarted after: "
                                    f"{self._last_failure}") from cause
            await self._restart(failure, cause)
        # Its time runs from the later of its sending and the result before it (results come
        # in plan order): steps out together are not counted twice.
        started, self._last_done = max(submitted, self._last_done), trio.current_time()
        self._steps += 1
        self._step_seconds += self._last_done - started
        self._record_ranks(result)
        return result

    def _record_ranks(self, result: StepResult) -> None:
        seconds = result.rank_execute_seconds or (result.execute_seconds,)
        collective = result.rank_collective_seconds or (result.collective_seconds,)
        if len(seconds) != len(self._rank_seconds):  # a group of another size (a test's fake)
            self._rank_seconds = [0.0] * len(seconds)
            self._rank_collective = [0.0] * len(seconds)
        for rank, (step, comm) in enumerate(zip(seconds, collective, strict=True)):
            self._rank_seconds[rank] += step
            self._rank_collective[rank] += comm
        self._rank_last, self._rank_last_collective = tuple(seconds), tuple(collective)
        self._grammar_seconds += result.grammar_seconds
        self._prepare_seconds += result.prepare_seconds
        self._forward_seconds += result.forward_seconds
        self._sample_seconds += result.sample_seconds

    async def _restart(self, failure: WorkerFailure, cause: BaseException) -> None:
        now = time.monotonic()
        self._failures.append(now)
        while now - self._failures[0] > self.restart_window:
            self._failures.popleft()
        self._last_failure = str(failure)
        self._generation += 1  # the steps sent to the failed group are lost with it
        if len(self._failures) > self.restart_budget:
            self._restarted.set()  # no restart: what waits for one learns the engine is dead
            self._dead = EngineDeadError(
                f"{len(self._failures)} worker failures within {self.restart_window:.0f}s exceed "
                f"the restart budget of {self.restart_budget}; the last: {failure}"
            )
            raise self._dead from cause
        self._restarts += 1
        self.restarting = True
        self._restarted = trio.Event()
        try:
            await self._workers.kill()
            self.info = await self._workers.load()
        except Exception as e:
            self._dead = EngineDeadError(f"restarting the workers failed after: {failure}")
            raise self._dead from e
        finally:
            self.restarting = False
            self._restarted.set()
        raise failure from cause

    def statistics(self) -> SupervisorStatistics:
        return SupervisorStatistics(
            worker_pids=self._group.pids if self._group is not None else (),
            worker_restarts=self._restarts,
            steps=self._steps,
            step_seconds_total=self._step_seconds,
            last_failure=self._last_failure,
            tensor_parallel_size=self.args.tensor_parallel_size,
            rank_step_seconds_total=tuple(self._rank_seconds),
            rank_collective_seconds_total=tuple(self._rank_collective),
            rank_last_step_seconds=self._rank_last,
            rank_last_collective_seconds=self._rank_last_collective,
            rank_peak_rss_bytes=tuple(info.peak_rss_bytes for info in self.worker_infos),
            grammar_seconds_total=self._grammar_seconds,
            prepare_seconds_total=self._prepare_seconds,
            forward_seconds_total=self._forward_seconds,
            sample_seconds_total=self._sample_seconds,
            encode_seconds_total=getattr(self._group, "encode_seconds", 0.0),
            decode_seconds_total=getattr(self._group, "decode_seconds", 0.0),
        )

    @property
    def worker_infos(self) -> tuple[WorkerInfo, ...]:
        """Every rank's WorkerInfo from the latest load, in rank order."""
        infos = getattr(self._group, "infos", ())
        return tuple(infos) or ((self.info,) if self.info is not None else ())
