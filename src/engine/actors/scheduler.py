"""The scheduler actor: admits requests, runs one step at a time on the worker group, and
hands each step's updates to the output actor. While a step runs in the worker process
this task sleeps on it, so intake and output work overlap the step instead of the worker
waiting for them."""

from __future__ import annotations

from collections.abc import Callable

import trio

from engine.actors.messages import (
    EngineFailed,
    Finished,
    NewRequest,
    OutputMessage,
    Registered,
    StepUpdates,
)
from engine.actors.supervisor import WorkerSupervisor
from engine.core.request import RequestStatus, make_requests
from engine.core.scheduler import Scheduler
from engine.errors import EngineDeadError, InvalidRequestError, WorkerFailure


class SchedulerActor:
    def __init__(
        self,
        scheduler: Scheduler,
        supervisor: WorkerSupervisor,
        inbox: trio.MemoryReceiveChannel[NewRequest],
        to_output: trio.MemorySendChannel[OutputMessage],
        *,
        max_model_len: int,
        eos_token_id: int | None,
        is_wanted: Callable[[str], bool],
    ) -> None:
        self.scheduler = scheduler
        self.supervisor = supervisor
        self._inbox = inbox
        self._to_output = to_output
        self._max_model_len = max_model_len
        self._eos_token_id = eos_token_id
        self._is_wanted = is_wanted  # False once the client of a request has gone away
        self._aborts: set[str] = set()
        self._stops: list[tuple[str, str]] = []
        self.idle_seconds = 0.0  # the worker waited on us while requests were unfinished
        self.dead: EngineDeadError | None = None

    def abort(self, request_id: str) -> None:
        """Takes effect before the next step; never blocks (callable from any trio task)."""
        self._aborts.add(request_id)

    def finish_on_stop_string(self, seq_id: str, stop_string: str) -> None:
        self._stops.append((seq_id, stop_string))

    async def run(self, *, task_status: trio.TaskStatus[SchedulerActor] = trio.TASK_STATUS_IGNORED) -> None:
        with self._inbox, self._to_output:
            task_status.started(self)
            last_step_end: float | None = None
            while True:
                await self._admit(wait=not self.scheduler.has_unfinished_requests())
                await self._apply_aborts_and_stops()
                if not self.scheduler.has_unfinished_requests():
                    last_step_end = None
                    continue
                plan = self.scheduler.schedule()
                started = trio.current_time()
                if last_step_end is not None:
                    self.idle_seconds += started - last_step_end
                try:
                    result = await self.supervisor.execute(plan)
                except WorkerFailure:
                    self.scheduler.requeue_all_running()
                    last_step_end = None
                    continue
                except EngineDeadError as error:
                    self.dead = error
                    await self._to_output.send(EngineFailed(error=error))
                    return
                last_step_end = trio.current_time()
                updates = self.scheduler.update_from_output(result)
                await self._to_output.send(StepUpdates(
                    updates=tuple(updates), time=last_step_end, started=started,
                    scheduled=tuple(s.seq_id for s in plan.new_sequences),
                ))

    async def _admit(self, *, wait: bool) -> None:
        """Takes every queued request; with ``wait``, sleeps until one comes (or an abort)."""
        while True:
            try:
                request = self._inbox.receive_nowait()
            except trio.WouldBlock:
                if not wait:
                    return
                request = await self._inbox.receive()
            wait = False
            await self._register(request)

    async def _register(self, request: NewRequest) -> None:
        if not self._is_wanted(request.request_id):
            return  # aborted between intake and here: never scheduled
        processed = request.processed
        try:
            sequences = make_requests(
                request.request_id, processed.prompt_token_ids, processed.params,
                arrival_time=request.arrival_time, max_model_len=self._max_model_len,
                eos_token_id=self._eos_token_id, priority=request.priority,
            )
            for index, sequence in enumerate(sequences):
                try:
                    self.scheduler.add_request(sequence)
                except InvalidRequestError:
                    self.scheduler.abort([s.request_id for s in sequences[:index]])
                    raise
        except InvalidRequestError as error:
            await self._to_output.send(Finished(request_ids=(request.request_id,), error=error))
            return
        await self._to_output.send(Registered(request=request, seq_ids=tuple(s.request_id for s in sequences)))

    async def _apply_aborts_and_stops(self) -> None:
        if self._stops:
            for seq_id, stop_string in self._stops:
                self.scheduler.finish_requests([seq_id], RequestStatus.FINISHED_STOPPED, stop_reason=stop_string)
            self._stops.clear()
        if self._aborts:
            aborted = tuple(self._aborts)
            self._aborts.clear()
            self.scheduler.abort(aborted)
            await self._to_output.send(Finished(request_ids=aborted))
