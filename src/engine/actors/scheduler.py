"""The scheduler actor: the engine core's driver in the async engine.

Two tasks share the actor's state (one trio thread, so they interleave only at awaits):

- the inbox task takes every message as it comes, a step in flight or not: new requests are
  admitted, aborts and stop-string finishes applied to the core at once (an idle scheduler
  wakes for them), and what the output actor must hear is queued in order;
- the step task keeps a step on the workers (with async scheduling two: the next one is
  planned and sent while the current one runs, and waits on the workers), and as each result
  comes in applies it, sends the next step, then that queue and the step's updates to the
  output actor, which builds the outputs while the workers run that next step.

So the inbox is drained while the worker computes and never fills behind a long step, and
the inbox task never waits on the output actor (which sends stop strings back here): the
two actors cannot block each other. While a step runs, this actor sleeps on the worker, so
intake and output work overlap the step instead of the worker waiting for them."""

from __future__ import annotations

import collections

import trio

from triode.engine.actors.messages import (
    Aborted,
    AbortRequests,
    EngineFailed,
    NewRequest,
    OutputMessage,
    Registered,
    SchedulerMessage,
    StepUpdates,
    StopStringFound,
)
from triode.engine.actors.supervisor import WorkerSupervisor
from triode.engine.core.engine_core import EngineCore
from triode.engine.errors import EngineDeadError, InvalidRequestError, WorkerFailure


class SchedulerActor:
    def __init__(
        self,
        core: EngineCore,
        supervisor: WorkerSupervisor,
        inbox: trio.MemoryReceiveChannel[SchedulerMessage],
        to_output: trio.MemorySendChannel[OutputMessage],
    ) -> None:
        self.core = core
        self.supervisor = supervisor
        self._inbox = inbox
        self._to_output = to_output
        self._outbox: collections.deque[OutputMessage] = collections.deque()
        self._work = trio.Event()  # set when the inbox task gave the step task something to do
        self.dead: EngineDeadError | None = None

    async def run(self, *, task_status: trio.TaskStatus[SchedulerActor] = trio.TASK_STATUS_IGNORED) -> None:
        with self._inbox, self._to_output:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._take_messages)
                task_status.started(self)
                await self._run_steps()
                # Dead: the inbox task stays, failing what still arrives, until the engine closes.

    async def _take_messages(self) -> None:
        async for message in self._inbox:
            match message:
                case NewRequest():
                    self._admit(message)
                case AbortRequests(request_ids=request_ids):
                    if self.dead is None:
                        unreported = self.core.unreported_updates(request_ids)
                        if aborted := self.core.abort_requests(request_ids):
                            self._outbox.append(Aborted(request_ids=tuple(aborted), unreported=tuple(unreported)))
                case StopStringFound(seq_id=seq_id, stop_string=stop_string):
                    if self.dead is None:
                        self.core.finish_on_stop_string(seq_id, stop_string)
            self._work.set()

    def _admit(self, request: NewRequest) -> None:
        stream = request.stream
        if stream.closed:
            return  # its client left between intake and here: never scheduled
        if self.dead is not None:
            stream.fail(EngineDeadError(f"the engine failed: {self.dead}"))
            return
        processed = request.processed
        try:
            seq_ids = self.core.add_request(
                request.request_id, processed.prompt_token_ids, processed.params,
                arrival_time=request.arrival_time, priority=request.priority,
                lora_request=processed.lora_request,
            )
        except InvalidRequestError as error:
            stream.fail(error)
            return
        self._outbox.append(Registered(request=request, seq_ids=seq_ids))
        if stream.abort_requested:  # AsyncLLM.abort reached the stream before the request got here
            self.core.abort_requests([request.request_id])
            self._outbox.append(Aborted(request_ids=(request.request_id,)))

    async def _flush(self) -> None:
        while self._outbox:
            await self._to_output.send(self._outbox.popleft())

    async def _run_steps(self) -> None:
        while True:
            await self._flush()
            self.core.send_steps(self.supervisor.submit, trio.current_time())
            if (step := self.core.oldest_step()) is None:
                await self._work.wait()
                self._work = trio.Event()
                continue
            try:
                result = await step.ticket()
            except WorkerFailure:
                self.core.step_failed()  # what was sent behind it went with the restarted workers
                continue
            except EngineDeadError as error:
                self.dead = error
                await self._flush()
                await self._to_output.send(EngineFailed(error=error))
                return
            now = trio.current_time()
            # It sends the next step too: the output actor works on these updates beside it.
            step, updates = self.core.complete_step(result, now, self.supervisor.submit)
            await self._flush()  # registrations and aborts first: they came before this result
            await self._to_output.send(StepUpdates(
                updates=tuple(updates), time=now, started=step.started,
                scheduled=tuple(s.seq_id for s in step.plan.new_sequences),
            ))
