"""The engine core: the one step loop's policy, which the sync and the async engines both drive.

Sans-IO like the rest of ``triode.engine.core``: a driver feeds it requests, aborts, stop-string
finishes and step results, passes the clock reading where one matters, and carries each
``StepPlan`` to the workers itself (``LLMEngine`` through a private trio loop, the scheduler
actor through the worker-supervisor). Every decision is made here, so the drivers cannot
drift apart:

- admission: a user request becomes its sequences (one per sample), all admitted or none;
- aborts by the user's request id, stop-string finishes by sequence id, at any time, a step
  in flight included (its result is then ignored for them);
- the step pipeline: ``send_steps`` plans steps while fewer are out than the engine runs at
  once (one, or two with async scheduling: the next is planned while the current one runs,
  and the workers feed it the tokens the first one samples) and hands each plan to the
  driver's ``send``, keeping what it returns as the step's ticket; ``complete_step`` applies
  the oldest step's result and sends the next steps at once, before the driver builds the
  outputs, so that the workers run the next step while it does (a stop string found then
  finishes its sequence, whose token from that step is dropped); ``step_failed`` drops every
  step in flight when the workers lost one (every running sequence is recomputed, as after a
  preemption). ``schedule`` and ``update_from_output`` are the two halves of a step
  underneath;
- the time the workers sat idle between steps while requests were unfinished, and the core's
  own time on the step pipeline (planning and sending steps; applying results);
- the prefix cache's events (``kv_cache_events``), handed to ``publish_kv_events`` after each
  step is planned and each result applied (one batch each, when there are any).
"""

from __future__ import annotations

import collections
import collections.abc
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any, Generic, TypeVar

import attrs

from triode.engine.config import EngineArgs
from triode.engine.core.kv_cache_events import KVCacheEvent
from triode.engine.core.scheduler import Scheduler
from triode.engine.core.scheduler_output import SchedulerStats, SequenceUpdate
from triode.engine.core.sequence import Sequence, SequenceStatus, make_sequences
from triode.engine.core.step_results import unreported_tokens
from triode.engine.errors import InvalidRequestError
from triode.engine.lora.request import LoRARequest
from triode.engine.pooling_params import PoolingParams
from triode.engine.sampling_params import SamplingParams
from triode.engine.worker_messages import StepPlan, StepResult, WorkerInfo

Ticket = TypeVar("Ticket")

logger = logging.getLogger("triode.engine")


@attrs.frozen
class StepInFlight(Generic[Ticket]):
    """A plan sent to the workers whose result is not applied yet: ``ticket`` is what the
    driver's ``send`` returned for it (what it waits on for the result), ``started`` when."""

    plan: StepPlan
    started: float
    ticket: Ticket


KVEventSink = Callable[[list[KVCacheEvent]], None]


def check_runner(runner: str, params: SamplingParams | PoolingParams) -> None:
    """Raises ``InvalidRequestError`` for a request the model does not run."""
    if runner == "pooling" and not isinstance(params, PoolingParams):
        raise InvalidRequestError("this model is a pooling model: it embeds (LLM.embed, /v1/embeddings) and "
                                  "generates nothing", field="model")
    if runner != "pooling" and isinstance(params, PoolingParams):
        raise InvalidRequestError("this model generates text: embeddings need a pooling model (--runner "
                                  "pooling)", field="model")


class EngineCore:
    def __init__(self, scheduler: Scheduler, *, max_model_len: int, eos_token_ids: collections.abc.Sequence[int],
                 publish_kv_events: KVEventSink | None = None, runner: str = "generate") -> None:
        """``eos_token_ids``: every end-of-sequence id of the model, its own (the tokenizer's)
        first: that one ends a sequence with ``stop_reason`` None, the others with their id.
        ``publish_kv_events``: where the prefix cache's events go (the scheduler's block
        manager must record them); it must not block. ``runner``: ``generate``, or
        ``pooling`` for a model that embeds (its requests carry PoolingParams)."""
        self.scheduler = scheduler
        self.runner = runner
        self._publish_kv_events = publish_kv_events
        self.max_model_len = max_model_len
        self.eos_token_ids = tuple(eos_token_ids)
        self.idle_seconds = 0.0  # the workers waited on the engine while requests were unfinished
        self.schedule_seconds = 0.0  # in send_steps: planning steps and handing them to ``send``
        self.apply_seconds = 0.0  # in complete_step: applying results
        self._last_step_end: float | None = None
        self._in_flight: collections.deque[StepInFlight[Any]] = collections.deque()  # plan order

    @classmethod
    def from_engine_args(
        cls, args: EngineArgs, worker: WorkerInfo, *, eos_token_ids: collections.abc.Sequence[int],
        publish_kv_events: KVEventSink | None = None,
    ) -> EngineCore:
        """The core for the workers' KV cache and maximum length (``worker``, rank 0's)."""
        logger.info("KV cache: %.2f GiB per rank (%s), %d tokens", worker.kv_cache_memory_bytes / 2**30,
                    worker.kv_cache_sizing, worker.num_blocks * worker.block_size)
        scheduler = Scheduler.from_engine_args(args, num_blocks=worker.num_blocks, kv_window=worker.kv_window,
                                               worker_device=worker.device,
                                               record_kv_events=publish_kv_events is not None,
                                               pooling=worker.runner == "pooling",
                                               whole_prompts_of=worker.max_model_len if worker.whole_prompts
                                               else None)
        return cls(scheduler, max_model_len=worker.max_model_len, eos_token_ids=eos_token_ids,
                   publish_kv_events=publish_kv_events, runner=worker.runner)

    # ---- requests in and out -------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: collections.abc.Sequence[int],
        params: SamplingParams | PoolingParams,
        *,
        arrival_time: float,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> tuple[str, ...]:
        """Admits a request's sequences (their ids are returned), or none of them: a request id
        in use, a sequence id of its ``n > 1`` samples that another request's sequence holds,
        a request the model does not run (generation on a pooling model, or the reverse), or
        a request that could not fit the KV cache raises ``InvalidRequestError``."""
        check_runner(self.runner, params)
        if not isinstance(request_id, str):
            raise InvalidRequestError(f"request_id: expected a string, got {type(request_id).__name__}",
                                      field="request_id")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise InvalidRequestError(f"priority: expected an integer, got {type(priority).__name__}", field="priority")
        scheduler = self.scheduler
        if request_id in scheduler.families:
            raise InvalidRequestError(f"request_id: {request_id!r} is already in use", field="request_id")
        sequences = make_sequences(
            request_id, prompt_token_ids, params, arrival_time=arrival_time,
            max_model_len=self.max_model_len, eos_token_ids=self.eos_token_ids, priority=priority,
            lora=lora_request,
        )
        for sequence in sequences:
            if sequence.seq_id in scheduler.sequences:
                raise InvalidRequestError(
                    f"request_id: sample {sequence.index} of {request_id!r} would be sequence "
                    f"{sequence.seq_id!r}, which another request holds",
                    field="request_id",
                )
            scheduler.check_fits(sequence)
        for sequence in sequences:
            scheduler.add_sequence(sequence)
        return tuple(s.seq_id for s in sequences)

    def abort_requests(self, request_ids: Iterable[str]) -> list[str]:
        """Aborts user requests (every sequence of each); returns the ids that were unfinished.
        Their blocks are free at once; unknown or finished ids are ignored (aborts race with
        normal completion)."""
        aborted = []
        for request_id in request_ids:
            family = self.scheduler.families.get(request_id)
            if family is not None:
                self.scheduler.abort([s.seq_id for s in family])
                aborted.append(request_id)
        return aborted

    def unreported_updates(self, request_ids: Iterable[str]) -> list[SequenceUpdate]:
        """For requests about to be aborted: the tokens their sequences sampled that the output
        side has not seen (``Sequence.reports_at_end``), as updates without a finish, so that
        the final output the abort gives carries them."""
        updates = []
        for request_id in request_ids:
            for seq in self.scheduler.families.get(request_id, ()):
                if tokens := unreported_tokens(seq):
                    updates.append(SequenceUpdate(seq.seq_id, seq.request_id, seq.index, tokens,
                                                  num_cached_tokens=seq.num_cached_tokens))
        return updates

    def finish_on_stop_string(self, seq_id: str, stop_string: str) -> None:
        """The output side found ``stop_string`` in the sequence's text: it ends now."""
        self.scheduler.finish([seq_id], SequenceStatus.FINISHED_STOPPED, stop_reason=stop_string)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def reset_prefix_cache(self) -> bool:
        """Empties the prefix cache where no request holds KV blocks (see
        ``BlockManager.reset_prefix_cache``); whether it did. KV-event subscribers hear of it
        at once."""
        reset = self.scheduler.block_manager.reset_prefix_cache()
        self._flush_kv_events()
        return reset

    # ---- one step ------------------------------------------------------------------------

    def can_schedule(self) -> bool:
        """Whether ``schedule`` may be called now: fewer steps are out than the engine runs at
        once (one, or two with async scheduling), and none of them speculates."""
        return self.scheduler.can_schedule()

    @property
    def steps_in_flight(self) -> int:
        return self.scheduler.steps_in_flight

    def schedule(self, now: float) -> StepPlan | None:
        """The next step's plan, or None when there is nothing to run (or, with a step in
        flight, nothing to plan ahead of its result)."""
        if not self.scheduler.has_unfinished_requests():
            return None
        ahead = self.scheduler.steps_in_flight > 0
        plan = self.scheduler.schedule()
        if not plan.chunks:
            if plan.wait_for_loads:
                return plan  # nothing to run until an adapter is read: ask the workers when it is
            if ahead or self.scheduler.waits_for_loads:
                return None  # e.g. the step in flight ends every running sequence by length
            # The scheduler's invariant (the most important sequence always progresses) rules
            # this out; a driver that waited here would hang its requests, one that looped
            # would spin.
            raise RuntimeError(f"step {plan.step_id}: unfinished requests but nothing scheduled")
        if self._last_step_end is not None and not ahead:
            self.idle_seconds += now - self._last_step_end
        return plan

    def update_from_output(self, result: StepResult, now: float) -> list[SequenceUpdate]:
        """Applies a step's result (token-id stop checks included); returns what changed."""
        updates = self.scheduler.update_from_output(result)
        busy = self.scheduler.steps_in_flight or not self.scheduler.has_unfinished_requests()
        self._last_step_end = None if busy else now
        return updates

    def step_failed(self) -> list[Sequence]:
        """The workers lost the oldest step in flight (and were restarted), and the steps sent
        behind it with them: they are dropped, and every running sequence is recomputed;
        returns those sequences."""
        self._in_flight.clear()
        self._last_step_end = None
        requeued = self.scheduler.requeue_all_running()
        self._flush_kv_events()
        return requeued

    # ---- the step pipeline ----------------------------------------------------------------

    def send_steps(self, send: Callable[[StepPlan], Ticket], now: float) -> None:
        """Plans steps while the core takes them and hands each to ``send``, which carries it
        to the workers and returns its ticket."""
        started = time.perf_counter()
        while self.can_schedule() and (plan := self.schedule(now)) is not None:
            self._in_flight.append(StepInFlight(plan, now, send(plan)))
        self._flush_kv_events()
        self.schedule_seconds += time.perf_counter() - started

    def oldest_step(self) -> StepInFlight[Any] | None:
        """The step whose result comes next, or None when none is out."""
        return self._in_flight[0] if self._in_flight else None

    def steps_sent(self) -> tuple[StepInFlight[Any], ...]:
        return tuple(self._in_flight)

    def complete_step(self, result: StepResult, now: float, send: Callable[[StepPlan], Ticket],
                      ) -> tuple[StepInFlight[Any], list[SequenceUpdate]]:
        """Applies the oldest step's ``result``, then sends the next steps (``send_steps``):
        returns that step, and what changed, for the driver to build outputs from while the
        workers run the next one."""
        started = time.perf_counter()
        step = self._in_flight.popleft()
        updates = self.update_from_output(result, now)
        self._flush_kv_events()
        self.apply_seconds += time.perf_counter() - started
        self.send_steps(send, now)
        return step, updates

    def _flush_kv_events(self) -> None:
        if self._publish_kv_events is not None and (events := self.scheduler.block_manager.take_events()):
            self._publish_kv_events(events)

    def statistics(self) -> SchedulerStats:
        return self.scheduler.statistics()
