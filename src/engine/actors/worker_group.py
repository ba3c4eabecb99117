"""What the supervisor drives: a worker group (``WorkerGroup``), the ticket its ``submit``
returns for a step, and how a group fails. ``actors.workers.ProcessWorkerGroup`` is the real
group; tests substitute an in-process fake (``tests/fake_workers.py``) so that actor behaviour
runs under trio's mock clock.

Every step goes to every rank; the ticket gives rank 0's result once every rank has replied,
carrying each rank's step and collective times, or raises the first failure, a crashed rank
before the errors its death causes in its peers."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Protocol

import attrs

from triode.engine.actors.step_channel import PendingStep
from triode.engine.worker_messages import StepPlan, StepResult, WorkerInfo

# A step on the workers: awaiting it gives its result (or raises what failed it).
StepTicket = Callable[[], Awaitable[StepResult]]


class WorkerCrashed(Exception):
    """A rank's process died; ``exit_code`` as the OS reported it."""

    def __init__(self, message: str, exit_code: int | None = None) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class WorkerGroup(Protocol):
    pids: tuple[int, ...]

    async def load(self) -> WorkerInfo: ...

    def submit(self, plan: StepPlan) -> StepTicket: ...

    async def kill(self) -> None: ...


async def rank0_result(pendings: list[PendingStep]) -> StepResult:
    """Rank 0's result once every rank has replied (``pendings`` in rank order); the first
    failure is raised instead."""
    for pending in pendings:
        await pending.done.wait()
    errors = [(rank, p.error) for rank, p in enumerate(pendings) if p.error is not None]
    if errors:
        crashes = [(rank, e) for rank, e in errors if isinstance(e, WorkerCrashed)]
        raise min(crashes or errors, key=lambda entry: entry[0])[1]
    results = [p.result for p in pendings if p.result is not None]  # each settled with one
    if len(results) == 1:
        return results[0]
    return attrs.evolve(
        results[0],
        rank_execute_seconds=tuple(r.execute_seconds for r in results),
        rank_collective_seconds=tuple(r.collective_seconds for r in results),
    )
