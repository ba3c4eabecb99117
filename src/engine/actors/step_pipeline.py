"""Steps run in plan order, each handed over from the one before it: async scheduling's relay.

With async scheduling a driver submits step N+1 while step N runs, naming N as the step it
follows (by step id, so it does not matter which of the two tasks trio starts first).
``StepPipeline.execute`` holds N+1 until N's result is in, fills in the tokens N sampled (``with_sampled_inputs``) and
starts N+1 on the worker-supervisor at once, inside the trio thread: the engine's own work on
N's result (applying it, detokenizing, delivering outputs) then happens while N+1 runs, not
between the two. A step whose predecessor failed is not run: the workers it was planned for
are gone (the supervisor restarted them), so it fails with ``WorkerFailure`` as well, and an
engine that died fails it with the same ``EngineDeadError``.
"""

from __future__ import annotations

import trio

from engine.actors.supervisor import WorkerSupervisor
from engine.errors import EngineDeadError, WorkerFailure
from engine.worker_messages import StepPlan, StepResult, with_sampled_inputs


class _Handoff:
    def __init__(self) -> None:
        self.done = trio.Event()
        self.result: StepResult | None = None
        self.error: BaseException | None = None


class StepPipeline:
    def __init__(self, supervisor: WorkerSupervisor) -> None:
        self.supervisor = supervisor
        self._handoffs: dict[int, _Handoff] = {}  # by step id, until the step after has read it

    def _handoff(self, step_id: int) -> _Handoff:
        return self._handoffs.setdefault(step_id, _Handoff())

    async def execute(self, plan: StepPlan, *, after: int | None = None) -> StepResult:
        """Runs ``plan`` and returns its result. ``after``: the step the plan was made ahead
        of, while it ran; the plan runs only once that step succeeded, with its sampled tokens
        filled in."""
        handoff = self._handoff(plan.step_id)
        if after is None:
            # A driver names no step only when none is out, so every earlier step has finished
            # and no later one reads their hand-offs. Pruning by step id alone would be wrong:
            # trio may start the tasks of steps submitted together in any order, and a step
            # must not drop the hand-off of one whose follower has not started yet.
            for step_id in [k for k, h in self._handoffs.items() if h is not handoff and h.done.is_set()]:
                del self._handoffs[step_id]
        try:
            if after is not None:
                previous = self._handoff(after)
                await previous.done.wait()
                self._handoffs.pop(after, None)
                plan = with_sampled_inputs(plan, self._result_of(previous, plan, after))
            handoff.result = await self.supervisor.execute(plan)
            return handoff.result
        except BaseException as error:
            handoff.error = error
            raise
        finally:
            handoff.done.set()

    @staticmethod
    def _result_of(previous: _Handoff, plan: StepPlan, after: int) -> StepResult:
        if isinstance(previous.error, EngineDeadError):
            raise EngineDeadError(str(previous.error)) from previous.error
        if previous.result is None:
            raise WorkerFailure(f"step {plan.step_id} was not run: step {after}, which it follows, "
                                f"failed ({previous.error!r})") from previous.error
        return previous.result
