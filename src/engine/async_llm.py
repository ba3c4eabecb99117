"""AsyncLLM: the trio library API.

    async with AsyncLLM.open(EngineArgs(...)) as llm:
        async for output in llm.generate("Hello", SamplingParams(max_tokens=32)):
            ...

``open`` starts the actors (worker-supervisor, output handler, scheduler, intake) in one
nursery and returns once the model is loaded. Cancelling the task that consumes
``generate`` aborts its request; the scheduler frees its KV blocks before the next step.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator, Sequence

import trio

from engine.actors.intake import IntakeActor
from engine.actors.messages import AddRequest, NewRequest, OutputMessage
from engine.actors.output import OutputActor
from engine.actors.scheduler import SchedulerActor
from engine.actors.streams import RequestStream
from engine.actors.supervisor import GroupOpener, WorkerSupervisor
from engine.config import EngineArgs
from engine.core.output_processor import OutputProcessor
from engine.core.scheduler import Scheduler
from engine.engine_stats import EngineStatistics, collect_statistics
from engine.errors import EngineDeadError, EngineShutdownError, InvalidRequestError, QueueFull
from engine.inputs import ChatMessage, InputProcessor, Prompt, load_tokenizer
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.worker.loading import resolve_model

# Between actors, a few messages of slack are enough: each is drained every step.
_ACTOR_CHANNEL_SIZE = 64


class AsyncLLM:
    def __init__(self, *, args: EngineArgs, model_path: str, tokenizer, supervisor: WorkerSupervisor,
                 intake: IntakeActor, scheduler: SchedulerActor, output: OutputActor,
                 streams: dict[str, RequestStream]) -> None:
        self.args = args
        self.model_path = model_path
        self.tokenizer = tokenizer
        self.supervisor = supervisor
        self.intake = intake
        self.scheduler = scheduler
        self.output = output
        self._streams = streams
        self._accepting = True
        info = supervisor.info
        self.max_model_len = info.max_model_len
        self.vocab_size = info.vocab_size

    @classmethod
    @contextlib.asynccontextmanager
    async def open(
        cls,
        args: EngineArgs | None = None,
        *,
        open_group: GroupOpener | None = None,
        **engine_args,
    ) -> AsyncIterator[AsyncLLM]:
        """``open_group`` replaces the worker processes (tests use an in-process fake)."""
        args = args if args is not None else EngineArgs(**engine_args)
        resolved = await trio.to_thread.run_sync(
            lambda: resolve_model(args.model, cache_dir=args.resolved_cache_dir())
        )
        tokenizer = await trio.to_thread.run_sync(load_tokenizer, resolved.path)
        streams: dict[str, RequestStream] = {}
        to_scheduler, scheduler_inbox = trio.open_memory_channel[NewRequest](_ACTOR_CHANNEL_SIZE)
        to_output, output_inbox = trio.open_memory_channel[OutputMessage](_ACTOR_CHANNEL_SIZE)
        async with trio.open_nursery() as nursery:
            supervisor = await nursery.start(
                WorkerSupervisor(args, str(resolved.path), open_group=open_group).run
            )
            info = supervisor.info
            scheduler = SchedulerActor(
                Scheduler.from_engine_args(args, num_blocks=info.num_blocks), supervisor,
                scheduler_inbox, to_output, max_model_len=info.max_model_len,
                eos_token_id=info.eos_token_ids[0] if info.eos_token_ids else None,
                is_wanted=lambda request_id: request_id in streams,
            )
            output = await nursery.start(
                OutputActor(OutputProcessor(tokenizer), output_inbox, streams, scheduler).run
            )
            await nursery.start(scheduler.run)
            processor = InputProcessor(tokenizer, max_model_len=info.max_model_len, vocab_size=info.vocab_size)
            intake = await nursery.start(
                IntakeActor(processor, to_scheduler, streams, capacity=args.max_queued_requests).run
            )
            llm = cls(args=args, model_path=str(resolved.path), tokenizer=tokenizer, supervisor=supervisor,
                      intake=intake, scheduler=scheduler, output=output, streams=streams)
            try:
                yield llm
            finally:
                llm._accepting = False
                nursery.cancel_scope.cancel()

    async def generate(
        self,
        prompt: Prompt | None,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        priority: int = 0,
        messages: Sequence[ChatMessage] | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Streams the request's outputs (cumulative or delta per ``params.output_kind``).
        Pass ``messages`` instead of ``prompt`` for a chat. Raises ``InvalidRequestError``,
        ``QueueFull``, ``EngineDeadError`` or ``EngineShutdownError``."""
        self.check_health()
        if not self._accepting:
            raise EngineShutdownError("the engine is shutting down and accepts no new requests")
        params = params if params is not None else SamplingParams()
        request_id = request_id if request_id is not None else uuid.uuid4().hex
        if request_id in self._streams:
            raise InvalidRequestError(f"request_id: {request_id!r} is already in use", field="request_id")
        stream = RequestStream(request_id, params.output_kind)
        self._streams[request_id] = stream
        try:
            try:
                self.intake.submit(AddRequest(
                    request_id=request_id, prompt=prompt,
                    messages=None if messages is None else tuple(messages),
                    params=params, priority=priority, arrival_time=trio.current_time(),
                ))
            except QueueFull:
                stream.finished = True
                raise
            while (output := await stream.get()) is not None:
                yield output
        finally:
            stream.closed = True
            del self._streams[request_id]
            if not stream.finished:
                self.scheduler.abort(request_id)

    async def abort(self, request_id: str) -> None:
        """Ends a request; its consumer receives a final output with finish_reason "abort"."""
        if request_id in self._streams:
            self.scheduler.abort(request_id)
        await trio.lowlevel.checkpoint()

    async def render_chat(self, messages: Sequence[ChatMessage], *, add_generation_prompt: bool = True) -> str:
        """The model's chat template applied to ``messages`` (InvalidRequestError if it can't)."""
        return await trio.to_thread.run_sync(
            lambda: self.intake.processor.render_chat(messages, add_generation_prompt=add_generation_prompt)
        )

    def check_health(self) -> None:
        if self.scheduler.dead is not None:
            raise EngineDeadError(f"the engine failed: {self.scheduler.dead}") from self.scheduler.dead

    @property
    def num_open_requests(self) -> int:
        return len(self._streams)

    def stop_accepting(self) -> None:
        self._accepting = False

    def statistics(self) -> EngineStatistics:
        return collect_statistics(self.scheduler.scheduler, self.supervisor, idle_seconds=self.scheduler.idle_seconds)
