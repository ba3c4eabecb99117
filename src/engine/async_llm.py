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
from typing import Any, Protocol

import trio

from triode.engine.actors.intake import IntakeActor
from triode.engine.actors.messages import AbortRequests, AddRequest, OutputMessage, SchedulerMessage
from triode.engine.actors.output import OutputActor
from triode.engine.actors.scheduler import SchedulerActor
from triode.engine.actors.streams import RequestStream
from triode.engine.actors.supervisor import GroupOpener, WorkerSupervisor
from triode.engine.chat_options import ChatMessage, ChatOptions
from triode.engine.config import EngineArgs
from triode.engine.core.engine_core import EngineCore, check_runner
from triode.engine.core.output_processor import OutputProcessor
from triode.engine.engine_stats import EngineStatistics, collect_statistics
from triode.engine.errors import EngineDeadError, EngineShutdownError, InvalidRequestError
from triode.engine.inputs import PromptInput
from triode.engine.kv_events.publisher import open_kv_event_publisher
from triode.engine.lora.request import LoRARequest
from triode.engine.model.setup import EngineModel, open_engine_model, open_input_processor
from triode.engine.outputs import EmbeddingRequestOutput, RequestOutput
from triode.engine.pooling_params import PoolingParams
from triode.engine.sampling_params import OutputKind, SamplingParams

# Between actors, a few messages of slack are enough: each is drained every step.
_ACTOR_CHANNEL_SIZE = 64
# An abort waits this long at most for room in the scheduler's inbox (which is drained
# continuously, a step in flight or not), so that a consumer's exit never hangs on it.
_ABORT_SEND_TIMEOUT = 10.0


class RequestObserver(Protocol):
    """What watches the requests of an :class:`AsyncLLM` (the server's metrics). A request is
    its stream: its id may be used again by the next request once the consumer left, while
    the engine still has the aborted one's last output to deliver."""

    def opened(self, stream: RequestStream, params: SamplingParams | PoolingParams) -> None: ...

    def output(self, stream: RequestStream, output: RequestOutput | EmbeddingRequestOutput) -> None: ...

    def closed(self, stream: RequestStream) -> None: ...


class AsyncLLM:
    def __init__(self, *, args: EngineArgs, model: EngineModel, supervisor: WorkerSupervisor,
                 intake: IntakeActor, scheduler: SchedulerActor, output: OutputActor,
                 to_scheduler: trio.MemorySendChannel[SchedulerMessage]) -> None:
        self.args = args
        self.model_path = str(model.path)
        self.tokenizer = model.tokenizer
        self.generation = model.generation
        self.supervisor = supervisor
        self.intake = intake
        self.scheduler = scheduler
        self.output = output
        self._to_scheduler = to_scheduler
        # The one table of open requests on the async path: the id check, the drain's idle
        # signal (_idle) and the observers (metrics) all work from it.
        self._open: dict[str, RequestStream] = {}  # this client side's generate() calls
        self._idle = trio.Event()
        self._idle.set()
        self._observers: list[RequestObserver] = []
        self._accepting = True
        self._failure: EngineDeadError | None = None  # set when an actor raised
        info = supervisor.info
        if info is None:
            raise RuntimeError("AsyncLLM needs a running worker-supervisor (its workers loaded)")
        self.max_model_len = info.max_model_len
        self.kv_cache_memory = info.kv_cache_memory_bytes  # per rank, given or sized from memory
        self.vocab_size = info.vocab_size
        self.runner = info.runner  # "generate", or "pooling" (encode, not generate)

    @classmethod
    @contextlib.asynccontextmanager
    async def open(
        cls,
        args: EngineArgs | None = None,
        *,
        open_group: GroupOpener | None = None,
        **engine_args: Any,
    ) -> AsyncIterator[AsyncLLM]:
        """``open_group`` replaces the worker processes (tests use an in-process fake)."""
        args = args if args is not None else EngineArgs.from_options(**engine_args)
        with contextlib.ExitStack() as stack:
            # Bound first: a taken endpoint fails start-up before the model loads.
            publisher = stack.enter_context(open_kv_event_publisher(args.kv_events_config))
            model = await trio.to_thread.run_sync(open_engine_model, args)
            to_scheduler, scheduler_inbox = trio.open_memory_channel[SchedulerMessage](_ACTOR_CHANNEL_SIZE)
            to_output, output_inbox = trio.open_memory_channel[OutputMessage](_ACTOR_CHANNEL_SIZE)
            stack.enter_context(to_scheduler)
            llm: AsyncLLM | None = None
            body_raised = False
            try:
                async with trio.open_nursery() as nursery:
                    supervisor = await nursery.start(
                        WorkerSupervisor(model.args, str(model.path), open_group=open_group).run
                    )
                    info = supervisor.info
                    core = EngineCore.from_engine_args(
                        args, info, eos_token_ids=model.generation.eos_token_ids,
                        publish_kv_events=publisher.publish if publisher is not None else None,
                    )
                    output = await nursery.start(
                        OutputActor(OutputProcessor(model.tokenizer), output_inbox, to_scheduler.clone()).run
                    )
                    scheduler = await nursery.start(
                        SchedulerActor(core, supervisor, scheduler_inbox, to_output).run
                    )
                    processor = open_input_processor(model, args, info)
                    intake = await nursery.start(
                        IntakeActor(processor, to_scheduler.clone(), capacity=args.max_queued_requests).run
                    )
                    llm = cls(args=args, model=model, supervisor=supervisor, intake=intake,
                              scheduler=scheduler, output=output, to_scheduler=to_scheduler)
                    try:
                        yield llm
                    except Exception:
                        body_raised = True  # the caller's block, not an actor (whose failure cancels it)
                        raise
                    finally:
                        llm._accepting = False
                        nursery.cancel_scope.cancel()
            except Exception as error:
                if llm is not None and not body_raised:  # an actor failed: its nursery cancelled the rest
                    llm._fail_open_requests(error)
                raise
            finally:
                if llm is not None:
                    llm._end_open_requests()

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate`` uses without SamplingParams: vLLM's defaults under the model's
        generation_config.json ones (unless ``--generation-config vllm``)."""
        return self.generation.sampling_params()

    async def generate(
        self,
        prompt: PromptInput | ChatOptions | None,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        priority: int = 0,
        messages: Sequence[ChatMessage] | None = None,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Streams the request's outputs (cumulative or delta per ``output_kind``). ``prompt``:
        text, token ids, a vLLM prompt dict, or ``ChatOptions`` for a chat (``messages=`` is
        the short form of the latter). ``lora_request``: the adapter it runs with (an engine
        with ``enable_lora``). Raises ``InvalidRequestError``, ``QueueFull``,
        ``EngineDeadError`` or ``EngineShutdownError``."""
        self.check_health()
        if not self._accepting:
            raise EngineShutdownError("the engine is shutting down and accepts no new requests")
        if messages is not None:
            if prompt is not None:
                raise InvalidRequestError("messages: pass either a prompt or messages", field="messages")
            prompt = ChatOptions(messages=messages)
        params = sampling_params if sampling_params is not None else self.get_default_sampling_params()
        async for output in self._request(prompt, params, request_id, priority, lora_request):
            assert isinstance(output, RequestOutput)
            yield output

    async def encode(
        self,
        prompt: PromptInput | ChatOptions,
        pooling_params: PoolingParams | None = None,
        request_id: str | None = None,
        *,
        priority: int = 0,
    ) -> AsyncIterator[EmbeddingRequestOutput]:
        """A pooling model's embedding of ``prompt``: one final output (vLLM's ``encode``).
        Raises as ``generate`` does; a generation model refuses it (``InvalidRequestError``)."""
        self.check_health()
        if not self._accepting:
            raise EngineShutdownError("the engine is shutting down and accepts no new requests")
        async for output in self._request(prompt, pooling_params or PoolingParams(), request_id, priority):
            assert isinstance(output, EmbeddingRequestOutput)
            yield output

    async def _request(self, prompt: PromptInput | ChatOptions | None, params: SamplingParams | PoolingParams,
                       request_id: str | None, priority: int, lora_request: LoRARequest | None = None,
                       ) -> AsyncIterator[RequestOutput | EmbeddingRequestOutput]:
        check_runner(self.runner, params)  # before the prompt is read
        if prompt is None:
            raise InvalidRequestError("prompt: is required", field="prompt")
        request_id = request_id if request_id is not None else uuid.uuid4().hex
        if request_id in self._open:
            raise InvalidRequestError(f"request_id: {request_id!r} is already in use", field="request_id")
        kind = params.output_kind if isinstance(params, SamplingParams) else OutputKind.FINAL_ONLY
        stream = RequestStream(request_id, kind)
        chat, text = (prompt, None) if isinstance(prompt, ChatOptions) else (None, prompt)
        self.intake.submit(AddRequest(  # QueueFull: nothing was queued, nothing to undo
            request_id=request_id, prompt=text, chat=chat,
            params=params, lora_request=lora_request, priority=priority, arrival_time=trio.current_time(),
            stream=stream,
        ))
        self._open[request_id] = stream
        self._idle = trio.Event() if len(self._open) == 1 else self._idle
        for observer in self._observers:
            observer.opened(stream, params)
        try:
            while (output := await stream.get()) is not None:
                yield output
        finally:
            stream.closed = True
            try:
                if not stream.finished:
                    await self._send_abort(request_id)
            finally:
                del self._open[request_id]  # the id is free once its abort is on its way
                for observer in self._observers:
                    observer.closed(stream)
                if not self._open:
                    self._idle.set()

    async def add_lora(self, lora_request: LoRARequest) -> None:
        """Reads and checks an adapter's files against the model (in a thread), so that a bad
        adapter fails here, not in a request; raises ``LoRAAdapterError`` naming it and the
        reason, or ``InvalidRequestError`` on an engine without ``enable_lora``."""
        await trio.to_thread.run_sync(self.intake.processor.check_lora, lora_request)

    def add_observer(self, observer: RequestObserver) -> None:
        """``observer`` hears of every request this engine opens, each of its outputs (from
        the output actor: it must not block) and its close (the consumer left; an aborted
        request's last output may come a step later)."""
        self._observers.append(observer)
        self.output.observers.append(observer.output)

    def open_request_ids(self) -> list[str]:
        """The requests whose consumers are still reading."""
        return list(self._open)

    async def wait_idle(self) -> None:
        """Returns once no request is open."""
        await self._idle.wait()

    async def _send_abort(self, request_id: str) -> None:
        with trio.move_on_after(_ABORT_SEND_TIMEOUT, shield=True):
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                await self._to_scheduler.send(AbortRequests(request_ids=(request_id,)))

    async def abort(self, request_id: str) -> None:
        """Ends a request; its consumer receives a final output with finish_reason "abort"."""
        stream = self._open.get(request_id)
        if stream is None or stream.finished:
            await trio.lowlevel.checkpoint()
            return
        stream.abort_requested = True  # in case the request has not reached the scheduler yet
        await self._send_abort(request_id)

    async def render_chat(self, chat: ChatOptions) -> str:
        """The chat template applied to ``chat`` (InvalidRequestError if it does not render)."""
        return await trio.to_thread.run_sync(self.intake.processor.render_chat, chat)

    async def reset_prefix_cache(self) -> bool:
        """Forgets every cached prompt block where no request holds KV blocks; False, changing
        nothing, while some do (as vLLM's does without ``reset_running_requests``)."""
        self.check_health()
        await trio.lowlevel.checkpoint()
        return self.scheduler.core.reset_prefix_cache()

    def check_health(self) -> None:
        if self.scheduler.dead is not None:
            raise EngineDeadError(f"the engine failed: {self.scheduler.dead}") from self.scheduler.dead
        if self._failure is not None:
            raise self._failure

    def _fail_open_requests(self, error: Exception) -> None:
        """An actor raised: the engine is gone, so every open request fails with the reason."""
        leaves = _leaves(error)
        reason = "; ".join(f"{type(leaf).__name__}: {leaf}" for leaf in leaves)
        self._failure = EngineDeadError(f"the engine failed: {reason}")
        self._failure.__cause__ = leaves[0] if len(leaves) == 1 else error
        self._accepting = False
        for stream in self._open.values():
            stream.fail(self._failure)

    def _end_open_requests(self) -> None:
        """The engine has closed: a request still open (its consumer outside the engine's
        nursery) fails rather than waiting for outputs that will not come."""
        for stream in self._open.values():
            stream.fail(EngineShutdownError("the engine closed while the request was open"))

    @property
    def num_open_requests(self) -> int:
        return len(self._open)

    def stop_accepting(self) -> None:
        self._accepting = False

    def statistics(self) -> EngineStatistics:
        return collect_statistics(
            self.scheduler.core, self.supervisor, output_seconds=self.output.processing_seconds,
            detokenize_seconds=self.output.processor.detokenize_seconds,
        )


# vLLM's name for its async engine (vLLM's own AsyncLLMEngine is its AsyncLLM too), so that ported
# code and vLLM's architecture documents find it under either.
AsyncLLMEngine = AsyncLLM


def _leaves(error: BaseException) -> list[BaseException]:
    if isinstance(error, BaseExceptionGroup):
        return [leaf for inner in error.exceptions for leaf in _leaves(inner)]
    return [error]
