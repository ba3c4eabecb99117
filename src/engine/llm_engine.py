"""LLMEngine: the sync engine whose caller drives the steps.

It runs the same sans-IO core as the async engine (Scheduler, InputProcessor,
OutputProcessor) and the same worker-supervisor actor, reached through a private trio loop.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from engine.actors.supervisor import WorkerSupervisor
from engine.config import EngineArgs
from engine.core.output_processor import OutputProcessor
from engine.core.request import RequestStatus, make_requests
from engine.core.scheduler import Scheduler
from engine.engine_stats import EngineStatistics, collect_statistics
from engine.errors import InvalidRequestError, WorkerFailure
from engine.inputs import InputProcessor, Prompt, load_tokenizer
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.sync_bridge import TrioThread
from engine.worker.loading import resolve_model


class LLMEngine:
    def __init__(self, args: EngineArgs) -> None:
        self.args = args
        resolved = resolve_model(args.model, cache_dir=args.resolved_cache_dir())
        self.model_path = resolved.path
        self.tokenizer = load_tokenizer(resolved.path)
        self._loop = TrioThread(WorkerSupervisor(args, str(resolved.path)).run)
        self.supervisor: WorkerSupervisor = self._loop.handle
        info = self.supervisor.info
        self.max_model_len = info.max_model_len
        self.eos_token_id = info.eos_token_ids[0] if info.eos_token_ids else None
        self.inputs = InputProcessor(self.tokenizer, max_model_len=info.max_model_len, vocab_size=info.vocab_size)
        self.scheduler = Scheduler.from_engine_args(args, num_blocks=info.num_blocks)
        self.outputs = OutputProcessor(self.tokenizer)
        self._idle_seconds = 0.0
        self._last_step_end: float | None = None

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLMEngine:
        return cls(args)

    def add_request(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams,
        *,
        priority: int = 0,
        chat: bool = False,
    ) -> None:
        """Validates and queues a request; raises ``InvalidRequestError`` naming the field."""
        if request_id in self.outputs.requests:
            raise InvalidRequestError(f"request_id: {request_id!r} is already in use", field="request_id")
        processed = self.inputs.process(prompt, params, chat=chat)
        now = time.monotonic()
        sequences = make_requests(
            request_id, processed.prompt_token_ids, processed.params, arrival_time=now,
            max_model_len=self.max_model_len, eos_token_id=self.eos_token_id, priority=priority,
        )
        for sequence in sequences:
            self.scheduler.add_request(sequence)
        self.outputs.add_request(
            request_id, prompt=processed.prompt, prompt_token_ids=processed.prompt_token_ids,
            params=processed.params, seq_ids=[s.request_id for s in sequences], arrival_time=now,
        )

    def step(self) -> list[RequestOutput]:
        """Runs one engine step and returns the outputs it produced."""
        plan = self.scheduler.schedule()
        if not plan.chunks:
            return []
        started = time.monotonic()
        if self._last_step_end is not None:
            self._idle_seconds += started - self._last_step_end
        try:
            result = self._loop.call(self.supervisor.execute, plan)
        except WorkerFailure:
            self.scheduler.requeue_all_running()
            return []
        finally:
            self._last_step_end = time.monotonic()
        self.outputs.mark_scheduled((s.seq_id for s in plan.new_sequences), started)
        processed = self.outputs.process(self.scheduler.update_from_output(result), time.monotonic())
        for seq_id, stop_string in processed.stop_string_finished:
            self.scheduler.finish_requests([seq_id], RequestStatus.FINISHED_STOPPED, stop_reason=stop_string)
        if not self.scheduler.has_unfinished_requests():
            self._last_step_end = None  # idle time only counts while work is waiting
        return processed.outputs

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        self.scheduler.abort(ids)
        for request_id in ids:
            self.outputs.abort(request_id, time.monotonic())

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def statistics(self) -> EngineStatistics:
        return collect_statistics(self.scheduler, self.supervisor, idle_seconds=self._idle_seconds)

    def close(self) -> None:
        self._loop.close()

    def __enter__(self) -> LLMEngine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
