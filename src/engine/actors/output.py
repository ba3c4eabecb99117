"""The output-handler actor: detokenizes, applies stop strings, builds RequestOutputs and
puts them on the per-request streams (which never block).

It owns the table of registered requests' streams: a stream enters with ``Registered`` and
leaves with the request's final output (or its failure). A stop string found here is sent
to the scheduler, which ends the sequence before its next step."""

from __future__ import annotations

import time
from collections.abc import Callable

import attrs
import trio

from triode.engine.actors.messages import (
    Aborted,
    EngineFailed,
    OutputMessage,
    Registered,
    SchedulerMessage,
    StepUpdates,
    StopStringFound,
)
from triode.engine.actors.streams import RequestStream
from triode.engine.core.output_processor import OutputProcessor
from triode.engine.outputs import EmbeddingRequestOutput, RequestOutput


@attrs.frozen(kw_only=True)
class OutputStatistics:
    open_requests: int
    outputs_sent: int


class OutputActor:
    def __init__(
        self,
        processor: OutputProcessor,
        inbox: trio.MemoryReceiveChannel[OutputMessage],
        to_scheduler: trio.MemorySendChannel[SchedulerMessage],
    ) -> None:
        self.processor = processor
        self._inbox = inbox
        self._to_scheduler = to_scheduler
        self._streams: dict[str, RequestStream] = {}
        self._outputs_sent = 0
        self.processing_seconds = 0.0  # detokenizing and building outputs, for statistics()
        # metrics, told each output with its request's stream; must not block
        self.observers: list[Callable[[RequestStream, RequestOutput | EmbeddingRequestOutput], None]] = []

    async def run(self, *, task_status: trio.TaskStatus[OutputActor] = trio.TASK_STATUS_IGNORED) -> None:
        with self._inbox, self._to_scheduler:
            task_status.started(self)
            async for message in self._inbox:
                await self._handle(message)

    async def _handle(self, message: OutputMessage) -> None:
        match message:
            case Registered(request=request, seq_ids=seq_ids):
                processed = request.processed
                self._streams[request.request_id] = request.stream
                self.processor.add_request(
                    request.request_id, prompt=processed.prompt,
                    prompt_token_ids=processed.prompt_token_ids, params=processed.params,
                    seq_ids=seq_ids, arrival_time=request.arrival_time,
                )
            case StepUpdates(updates=updates, time=now, started=started, scheduled=scheduled):
                processing_started = time.perf_counter()
                self.processor.mark_scheduled(scheduled, started)
                step = self.processor.process(updates, now)
                self.processing_seconds += time.perf_counter() - processing_started
                for seq_id, stop_string in step.stop_string_finished:
                    await self._to_scheduler.send(StopStringFound(seq_id=seq_id, stop_string=stop_string))
                for output in step.outputs:
                    self._deliver(output)
            case Aborted(request_ids=request_ids, unreported=unreported):
                for output in self.processor.process(unreported, trio.current_time()).outputs:
                    self._deliver(output)  # none: these requests want only the final output built below
                for request_id in request_ids:
                    if (aborted := self.processor.abort(request_id, trio.current_time())) is not None:
                        self._deliver(aborted)
                    elif (stream := self._streams.pop(request_id, None)) is not None:
                        stream.end()  # a pooling request: no partial result
            case EngineFailed(error=error):
                for stream in self._streams.values():
                    stream.fail(error)
                self._streams.clear()
                for request_id in [*self.processor.requests, *self.processor.pooling]:
                    self.processor.forget(request_id)

    def _deliver(self, output: RequestOutput | EmbeddingRequestOutput) -> None:
        self._outputs_sent += 1
        stream = self._streams.get(output.request_id)
        if stream is not None:
            for observe in self.observers:
                observe(stream, output)
            stream.put(output)
            if output.finished:
                del self._streams[output.request_id]

    def statistics(self) -> OutputStatistics:
        return OutputStatistics(open_requests=len(self.processor.requests), outputs_sent=self._outputs_sent)
