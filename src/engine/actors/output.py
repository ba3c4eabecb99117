"""The output-handler actor: detokenizes, applies stop strings, builds RequestOutputs and
puts them on the per-request streams (which never block). A stop string found here ends
the sequence in the scheduler before its next step."""

from __future__ import annotations

import attrs
import trio

from engine.actors.messages import EngineFailed, Finished, OutputMessage, Registered, StepUpdates
from engine.actors.scheduler import SchedulerActor
from engine.actors.streams import RequestStream
from engine.core.output_processor import OutputProcessor


@attrs.frozen(kw_only=True)
class OutputStatistics:
    open_requests: int
    outputs_sent: int


class OutputActor:
    def __init__(
        self,
        processor: OutputProcessor,
        inbox: trio.MemoryReceiveChannel[OutputMessage],
        streams: dict[str, RequestStream],
        scheduler: SchedulerActor,
    ) -> None:
        self.processor = processor
        self._inbox = inbox
        self._streams = streams
        self._scheduler = scheduler
        self._outputs_sent = 0
        self.observers: list = []  # callables(RequestOutput) for metrics; must not block

    async def run(self, *, task_status: trio.TaskStatus[OutputActor] = trio.TASK_STATUS_IGNORED) -> None:
        with self._inbox:
            task_status.started(self)
            async for message in self._inbox:
                self._handle(message)

    def _handle(self, message: OutputMessage) -> None:
        match message:
            case Registered(request=request, seq_ids=seq_ids):
                processed = request.processed
                self.processor.add_request(
                    request.request_id, prompt=processed.prompt,
                    prompt_token_ids=processed.prompt_token_ids, params=processed.params,
                    seq_ids=seq_ids, arrival_time=request.arrival_time,
                )
            case StepUpdates(updates=updates, time=now, started=started, scheduled=scheduled):
                self.processor.mark_scheduled(scheduled, started)
                step = self.processor.process(updates, now)
                for seq_id, stop_string in step.stop_string_finished:
                    self._scheduler.finish_on_stop_string(seq_id, stop_string)
                for output in step.outputs:
                    self._deliver(output)
            case Finished(request_ids=request_ids, reason=reason, error=error):
                for request_id in request_ids:
                    if error is not None:
                        self._fail(request_id, error)
                    elif (output := self.processor.abort(request_id, trio.current_time(), reason)) is not None:
                        self._deliver(output)
            case EngineFailed(error=error):
                for request_id in list(self._streams):
                    self._fail(request_id, error)
                for request_id in list(self.processor.requests):
                    self.processor.forget(request_id)

    def _deliver(self, output) -> None:
        self._outputs_sent += 1
        for observe in self.observers:
            observe(output)
        stream = self._streams.get(output.request_id)
        if stream is not None:
            stream.put(output)

    def _fail(self, request_id: str, error: Exception) -> None:
        self.processor.forget(request_id)
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.fail(error)

    def statistics(self) -> OutputStatistics:
        return OutputStatistics(open_requests=len(self.processor.requests), outputs_sent=self._outputs_sent)
