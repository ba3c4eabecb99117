"""LLMEngine: the sync engine whose caller drives the steps (vLLM's ``LLMEngine`` surface).

It drives the same ``EngineCore`` as the async engine's scheduler actor, with the same
``InputProcessor`` and ``OutputProcessor``, and reaches the same worker-supervisor actor
through a private trio loop. ``step`` is schedule -> run -> apply the result and send the
next step (the core's ``complete_step``) -> build the outputs, so that detokenizing and
building ``RequestOutput``s overlap the next step on the workers. With async scheduling (by
default on GPU workers) it also plans the next step before it waits and sends it to the
workers at once, where it starts the moment the current step is done, so applying the result
overlaps it too. A step the caller stopped waiting for (KeyboardInterrupt) keeps running on
the workers and is collected by the next ``step``, so the core and the workers never disagree
about what ran. Making and handing over a plan, and applying a result, hold a
KeyboardInterrupt off until they are done (a few milliseconds): it lands only in the wait.

The workers stop on ``close``, when the engine is garbage-collected, or at interpreter exit.
"""

from __future__ import annotations

import concurrent.futures
import time
import weakref
from collections.abc import Iterable
from typing import Any

from triode.engine.actors.supervisor import WorkerSupervisor
from triode.engine.chat_options import ChatOptions
from triode.engine.config import EngineArgs
from triode.engine.core.engine_core import EngineCore, check_runner
from triode.engine.core.output_processor import OutputProcessor
from triode.engine.engine_stats import EngineStatistics, collect_statistics
from triode.engine.errors import EngineDeadError, WorkerFailure
from triode.engine.inputs import PromptInput
from triode.engine.kv_events.publisher import ZmqEventPublisher, start_kv_event_publisher
from triode.engine.lora.request import LoRARequest
from triode.engine.model.setup import open_engine_model, open_input_processor
from triode.engine.outputs import EmbeddingRequestOutput, RequestOutput
from triode.engine.pooling_params import PoolingParams
from triode.engine.sampling_params import SamplingParams
from triode.engine.sync_bridge import TrioThread, deferred_keyboard_interrupt
from triode.engine.worker_messages import StepPlan, StepResult


class LLMEngine:
    def __init__(self, args: EngineArgs) -> None:
        self.args = args
        # Bound first: a taken endpoint fails before the model loads.
        publisher = start_kv_event_publisher(args.kv_events_config)
        try:
            model = open_engine_model(args)
            self._loop = TrioThread(WorkerSupervisor(model.args, str(model.path)).run)
        except BaseException:
            if publisher is not None:
                publisher.close()
            raise
        self.model_path = model.path
        self.tokenizer = model.tokenizer
        self.generation = model.generation
        # Holds the loop and the publisher, not the engine: a dropped engine is collected, and
        # its workers stop.
        self._finalizer = weakref.finalize(self, _close, self._loop, publisher)
        self.supervisor: WorkerSupervisor = self._loop.handle
        info = self.supervisor.info
        self.max_model_len = info.max_model_len
        self.vocab_size = info.vocab_size
        self.core = EngineCore.from_engine_args(
            args, info, eos_token_ids=model.generation.eos_token_ids,
            publish_kv_events=publisher.publish if publisher is not None else None,
        )
        self.inputs = open_input_processor(model, args, info)
        self.outputs = OutputProcessor(self.tokenizer)
        self._output_seconds = 0.0  # building outputs, for statistics() (the core times its own work)
        self._dead: EngineDeadError | None = None

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLMEngine:
        return cls(args)

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's defaults under the model's generation_config.json ones (unless
        ``generation_config="vllm"``): what a request without SamplingParams gets."""
        return self.generation.sampling_params()

    def add_request(
        self,
        request_id: str,
        prompt: PromptInput | ChatOptions,
        params: SamplingParams | PoolingParams | None = None,
        *,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Validates and queues a request (all its ``n`` samples, or nothing): raises
        ``InvalidRequestError`` naming the field. PoolingParams: an embedding, from a pooling
        model. ``lora_request``: the adapter it runs with (an engine with ``enable_lora``)."""
        self._check_alive()
        params = params if params is not None else self.get_default_sampling_params()
        check_runner(self.core.runner, params)  # before the prompt is read
        processed = self.inputs.process(prompt, params, lora_request)
        now = time.monotonic()
        with deferred_keyboard_interrupt():  # the core and the output side learn of it together
            seq_ids = self.core.add_request(
                request_id, processed.prompt_token_ids, processed.params, arrival_time=now,
                priority=priority, lora_request=processed.lora_request,
            )
            self.outputs.add_request(
                request_id, prompt=processed.prompt, prompt_token_ids=processed.prompt_token_ids,
                params=processed.params, seq_ids=seq_ids, arrival_time=now,
            )

    def add_lora(self, lora_request: LoRARequest) -> None:
        """Reads and checks an adapter's files against the model before any request uses it
        (``LoRAAdapterError`` naming it and the reason)."""
        self.inputs.check_lora(lora_request)

    def step(self) -> list[RequestOutput | EmbeddingRequestOutput]:
        """Runs one engine step and returns the outputs it produced."""
        self._check_alive()
        with deferred_keyboard_interrupt():
            self.core.send_steps(self._send, time.monotonic())
        if (step := self.core.oldest_step()) is None:
            return []
        try:
            result = step.ticket.result()  # where a KeyboardInterrupt lands: the step goes on
        except WorkerFailure:
            with deferred_keyboard_interrupt():
                self._collect_steps_sent()
                self.core.step_failed()
            return []
        except EngineDeadError as error:
            self._collect_steps_sent()
            self._dead = error
            raise
        with deferred_keyboard_interrupt():
            now = time.monotonic()
            step, updates = self.core.complete_step(result, now, self._send)  # and sends the next
            started = time.perf_counter()
            self.outputs.mark_scheduled((s.seq_id for s in step.plan.new_sequences), step.started)
            processed = self.outputs.process(updates, now)
            for seq_id, stop_string in processed.stop_string_finished:
                self.core.finish_on_stop_string(seq_id, stop_string)
            self._output_seconds += time.perf_counter() - started
        return processed.outputs

    def _send(self, plan: StepPlan) -> concurrent.futures.Future[StepResult]:
        return self._loop.submit(lambda: self.supervisor.submit(plan))

    def _collect_steps_sent(self) -> None:
        """After a failed step: the steps sent behind it were lost with the restarted workers
        and fail at once; their outcomes are collected before the core drops them."""
        concurrent.futures.wait([step.ticket for step in self.core.steps_sent()])

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        with deferred_keyboard_interrupt():
            self.core.abort_requests(ids)
            now = time.monotonic()
            for request_id in ids:
                self.outputs.abort(request_id, now)

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached prompt block, so that the next requests compute their prompts
        again (a benchmark that repeats prompts, new weights behind the same name). Only while
        no request holds KV blocks, as between ``LLM.generate`` calls: returns False, and
        changes nothing, otherwise (as vLLM does while blocks are in use)."""
        self._check_alive()
        return self.core.reset_prefix_cache()

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"the engine failed: {self._dead}") from self._dead

    def statistics(self) -> EngineStatistics:
        return collect_statistics(self.core, self.supervisor, output_seconds=self._output_seconds,
                                  detokenize_seconds=self.outputs.detokenize_seconds)

    def close(self) -> None:
        """Stops the workers (also done when the engine is collected, or at exit)."""
        self._finalizer()

    def __enter__(self) -> LLMEngine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _close(loop: TrioThread, publisher: ZmqEventPublisher | None) -> None:
    loop.close()
    if publisher is not None:
        publisher.close()
