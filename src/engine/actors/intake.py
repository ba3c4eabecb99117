"""The request-intake actor: validation, chat templates and tokenization off the event loop.

Clients ``submit`` without waiting: a full queue raises ``QueueFull`` at once (HTTP 503), so
backpressure reaches the client instead of growing memory. Bad input raises a ``TriodeError``
that fails its request; any other exception is a fault in processing that one request, so it
fails that request alone (logged) and the engine serves on."""

from __future__ import annotations

import logging
from collections.abc import Mapping

import attrs
import trio

from triode.engine.actors.messages import AddRequest, NewRequest, SchedulerMessage
from triode.engine.errors import InvalidRequestError, QueueFull, TriodeError
from triode.engine.inputs import InputProcessor, ProcessedPrompt
from triode.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@attrs.frozen(kw_only=True)
class IntakeStatistics:
    queued: int
    capacity: int
    accepted: int
    rejected: int


class IntakeActor:
    def __init__(
        self,
        processor: InputProcessor,
        to_scheduler: trio.MemorySendChannel[SchedulerMessage],
        *,
        capacity: int,
    ) -> None:
        self.processor = processor
        self._to_scheduler = to_scheduler
        self._capacity = capacity
        self._inbox_send, self._inbox = trio.open_memory_channel[AddRequest](capacity)
        self._accepted = 0
        self._rejected = 0

    def submit(self, request: AddRequest) -> None:
        try:
            self._inbox_send.send_nowait(request)
        except trio.WouldBlock:
            raise QueueFull(
                f"the engine's intake queue is full ({self._capacity} requests); retry later"
            ) from None

    async def run(self, *, task_status: trio.TaskStatus[IntakeActor] = trio.TASK_STATUS_IGNORED) -> None:
        with self._to_scheduler, self._inbox:
            task_status.started(self)
            async for request in self._inbox:
                if request.stream.closed:
                    continue  # the client left while the request queued
                try:
                    if (request.chat is not None or isinstance(request.prompt, str | Mapping)
                            or request.lora_request is not None  # its files are read on first use
                            or (isinstance(request.params, SamplingParams)
                                and request.params.structured_outputs is not None)):
                        # Templates, tokenizers and grammar compilation take real time (and
                        # release the GIL): never on the event loop.
                        processed = await trio.to_thread.run_sync(self._process, request)
                    else:
                        processed = self._process(request)  # token ids: a linear check
                except TriodeError as error:
                    self._rejected += 1
                    request.stream.fail(error)
                    continue
                except Exception as error:  # a fault in one request's processing fails it alone
                    logger.exception("processing request %s failed", request.request_id)
                    self._rejected += 1
                    request.stream.fail(error)
                    continue
                self._accepted += 1
                await self._to_scheduler.send(NewRequest(
                    request_id=request.request_id, processed=processed, priority=request.priority,
                    arrival_time=request.arrival_time, stream=request.stream,
                ))

    def _process(self, request: AddRequest) -> ProcessedPrompt:
        if request.chat is not None:
            return self.processor.process(request.chat, request.params, request.lora_request)
        if request.prompt is None:
            raise InvalidRequestError("a request needs a prompt or a chat", field="prompt")
        return self.processor.process(request.prompt, request.params, request.lora_request)

    def statistics(self) -> IntakeStatistics:
        return IntakeStatistics(
            queued=self._inbox_send.statistics().current_buffer_used,
            capacity=self._capacity,
            accepted=self._accepted,
            rejected=self._rejected,
        )
