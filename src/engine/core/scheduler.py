"""Continuous batching in the vLLM v1 style: one token budget per step, no prefill/decode phases.

Each ``schedule()`` hands out up to ``max_num_batched_tokens`` tokens: first to running
sequences (one token for a decode, or the next chunk of an unfinished prefill), then to waiting
ones in policy order (``core.sequence_queues``). A sequence's chunk is whatever remains of its
known tokens, cut by the budget and ``long_prefill_token_threshold``; the step samples only
for chunks that reach the end of the known tokens.

When blocks run out, the least important running sequence (highest priority value, then latest
arrival) is preempted by recompute: its blocks are freed and it returns to the waiting queue.
The most important sequence is never the victim while another runs, and each one fits alone
(checked by ``add_sequence``), so it always progresses: no deadlock, no livelock, and under FCFS
the oldest seq is never starved. Under the priority policy a stream of more important
requests may delay a less important one indefinitely, as priorities intend. With LoRA
adapters, a sequence whose adapter is being read is passed by the others; one that waits for a
free adapter slot is passed only by the base model's sequences, so the adapters running finish
and one frees.

Up to ``max_steps_in_flight`` plans are out at once: one, or two with async scheduling, where
step N+1 is planned while step N runs. A plan made ahead counts the tokens of the step in
flight as scheduled: a prefill continues with its next chunk, and a sequence whose token is
being sampled is fed that token, which the plan leaves to the workers, who sampled it
(``ScheduledChunk.sampled_input``). Short of blocks, a sequence that would be its own victim
while a step in flight has its tokens waits for a later plan: that step's result may free
blocks behind a sliding window, and preempting would throw the step away (a recompute that
needed those blocks did so every step, and never finished). Results are applied in plan
order (``update_from_output``, ``core.step_results``; ``requeue_all_running()`` if the worker
died). With speculative decoding (``spec_decode.scheduling``) no step is planned ahead of one
that verifies or proposes tokens: what it emits is unknown until its result.
"""

from __future__ import annotations

import bisect
import collections

from triode.engine.config import EngineArgs
from triode.engine.core.kv_blocks import BlockManager
from triode.engine.core.lora_loads import AdapterSlots
from triode.engine.core.scheduler_output import (
    ITERATION_TOKEN_BUCKETS,
    SchedulerStats,
    SequenceUpdate,
)
from triode.engine.core.sequence import Sequence, SequenceStatus
from triode.engine.core.sequence_queues import SequenceQueues, adapter_names
from triode.engine.core.step_results import PlannedChunk, abort_failed_adapters, apply_step_result
from triode.engine.spec_decode.policy import SpeculationPolicy, speculation_policy
from triode.engine.spec_decode.scheduling import ask_for_proposals, drafts_to_verify
from triode.engine.worker_messages import NewSequence, ScheduledChunk, StepPlan, StepResult


class Scheduler(SequenceQueues):
    def __init__(
        self,
        block_manager: BlockManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        long_prefill_token_threshold: int | None = None,
        scheduling_policy: str = "fcfs",
        max_steps_in_flight: int = 1,
        whole_prompts: bool = False,
        max_loras: int | None = None,
        speculation: SpeculationPolicy | None = None,
    ) -> None:
        """``whole_prompts``: a prompt is never cut into chunks (an encoder's, whose every token
        attends to every other); ``max_num_batched_tokens`` must then hold the longest one.
        ``max_loras``: the most LoRA adapters the running sequences may use at once (the
        workers' slots). An adapter's sequences wait until the workers have read it
        (``core.lora_loads``) while others pass them; one that waits for a slot is passed by
        the base model's sequences only, so the running adapters' sequences end and free one."""
        if max_steps_in_flight not in (1, 2):
            raise ValueError(f"max_steps_in_flight must be 1 or 2, got {max_steps_in_flight}")
        super().__init__(block_manager, max_num_batched_tokens=max_num_batched_tokens,
                         scheduling_policy=scheduling_policy)
        self.max_steps_in_flight = max_steps_in_flight
        self.max_num_seqs = max_num_seqs
        self.long_prefill_token_threshold = None if whole_prompts else long_prefill_token_threshold
        self.whole_prompts = whole_prompts
        self.max_loras = max_loras
        self.speculation = speculation
        self._step_id = 0
        # Each step out (plan order): its id, its sequences' shares, and whether it speculates
        # (verifies or asks for proposed tokens: what it emits is known only from its result).
        self._in_flight: collections.deque[tuple[int, dict[str, PlannedChunk], bool]] = collections.deque()
        self._iteration_tokens = [0] * (len(ITERATION_TOKEN_BUCKETS) + 1)
        self._iteration_tokens_sum = 0

    @classmethod
    def from_engine_args(cls, args: EngineArgs, *, num_blocks: int, kv_window: int | None = None,
                         worker_device: str = "cpu", record_kv_events: bool = False,
                         pooling: bool = False, whole_prompts_of: int | None = None) -> Scheduler:
        """``kv_window``: the model's sliding window when every layer has one (its blocks
        behind the window are freed as sequences advance); ``worker_device``: where the
        workers run (async scheduling's default depends on it); ``pooling``: the model embeds,
        so no prefix cache (a pooler reads every prompt token's hidden state, which a cache hit
        would skip); ``whole_prompts_of``: an encoder's maximum length, every prompt of which
        runs whole (the token budget is raised to it if lower)."""
        return cls(
            BlockManager(num_blocks, args.block_size, args.enable_prefix_caching and not pooling,
                         sliding_window=kv_window,
                         record_events=record_kv_events),
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=max(args.max_num_batched_tokens, whole_prompts_of or 0),
            long_prefill_token_threshold=args.long_prefill_token_threshold,
            scheduling_policy=args.scheduling_policy,
            max_steps_in_flight=2 if args.async_scheduling_on(worker_device) else 1,
            whole_prompts=whole_prompts_of is not None,
            max_loras=args.max_loras if args.enable_lora else None,
            speculation=speculation_policy(args, worker_device) if not pooling else None,
        )

    def requeue_all_running(self) -> list[Sequence]:
        """After a worker restart: as ``SequenceQueues.requeue_all_running``, and the steps in
        flight are dropped."""
        self._in_flight.clear()
        return super().requeue_all_running()

    # ---- one step ------------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        """The next step's plan. A plan without chunks needs no result and need not be sent:
        its ``finished_seq_ids`` are repeated in the next plan that has chunks."""
        if len(self._in_flight) >= self.max_steps_in_flight:
            raise RuntimeError(f"schedule() called with {len(self._in_flight)} steps in flight")
        bm = self.block_manager
        budget = self.max_num_batched_tokens
        threshold = self.long_prefill_token_threshold or budget
        chunks: dict[str, ScheduledChunk] = {}
        planned: dict[str, PlannedChunk] = {}  # each chunk's record, kept until its result
        new_sequences: list[NewSequence] = []
        short_of_blocks = False  # a running sequence was preempted, or left for a later step

        # Running sequences first: decodes and unfinished prefills, in admission order. This
        # loop runs for every sequence of every step: it reads plain attributes, and asks the
        # block manager only when the sequence's last block lacks room.
        block_size = bm.block_size
        i = 0
        running = self.running
        while i < len(running) and budget > 0:
            seq = running[i]
            num_new = seq.num_to_feed(threshold if threshold < budget else budget)
            if num_new == 0:
                i += 1
                continue
            drafts = drafts_to_verify(seq, budget - num_new) if seq.draft_token_ids else ()
            needed = num_new + len(drafts)
            fits = seq.num_computed_tokens + seq.num_in_flight_tokens + needed <= len(seq.block_ids) * block_size
            while not fits and bm.allocate_slots(seq, needed) is None:
                short_of_blocks = True
                victim = max(self.running, key=self._key)
                if victim is seq and seq.num_in_flight_tokens:  # it waits for its step (above)
                    i += 1
                    break
                position = self.running.index(victim)
                del self.running[position]
                if victim.seq_id in chunks:
                    budget += chunks.pop(victim.seq_id).num_tokens
                    del planned[victim.seq_id]
                self._preempt(victim)
                if victim is seq:
                    break
                if position < i:
                    i -= 1
            else:
                chunks[seq.seq_id] = self._chunk(seq, num_new, planned, drafts)
                budget -= needed
                i += 1

        # Then waiting ones, unless a running one was short of blocks (they would only thrash).
        if not short_of_blocks:
            slots = AdapterSlots(self.lora_loads, self.max_loras, (s.lora for s in self.running))
            for seq in list(self.waiting):
                if len(self.running) >= self.max_num_seqs or budget == 0:
                    break
                if self.sibling_is_prefilling(seq):
                    continue  # share its prompt blocks once they are cached
                if seq.lora is not None and not slots.admits(seq.lora):
                    continue

                hits, num_hit_tokens = bm.get_computed_blocks(seq)
                num_new = min(seq.num_tokens - num_hit_tokens, threshold, budget)
                if self.whole_prompts and num_new < seq.num_tokens - num_hit_tokens:
                    break  # it runs whole in a later step, first in line
                if bm.allocate_slots(seq, num_new, hits) is None:
                    break  # no queue jumping: the head waits for blocks, and gets them
                if seq.status == SequenceStatus.WAITING:
                    seq.num_cached_tokens = num_hit_tokens
                self.waiting.remove(seq)
                self.running.append(seq)
                if seq.lora is not None:
                    slots.admitted(seq.lora)
                seq.status = SequenceStatus.RUNNING
                seq.known_to_worker = True
                new_sequences.append(
                    NewSequence(
                        seq_id=seq.seq_id,
                        prompt_token_ids=seq.prompt_token_ids,
                        output_token_ids=tuple(seq.output_token_ids),
                        params=seq.params,
                        eos_token_ids=seq.eos_token_ids,
                        pooling=seq.pooling,
                        lora=seq.lora,
                    )
                )
                chunks[seq.seq_id] = self._chunk(seq, num_new, planned)
                budget -= num_new

        if self.speculation is not None and chunks:
            ask_for_proposals(self.speculation, chunks, self.sequences, len(self.running))
        self._step_id += 1
        finished = tuple(self._finished_seq_ids)
        loads = self.lora_loads
        wait_for_loads = not chunks and bool(loads.loading) and loads.poll is None
        if wait_for_loads:
            loads.poll = self._step_id
        if chunks:
            self._finished_seq_ids = []
            fed = self.max_num_batched_tokens - budget
            self._iteration_tokens[bisect.bisect_left(ITERATION_TOKEN_BUCKETS, fed)] += 1
            self._iteration_tokens_sum += fed
            # (drafts and proposals come from a speculation policy only)
            speculates = self.speculation is not None and any(
                chunk.num_draft_tokens or chunk.propose for chunk in chunks.values())
            self._in_flight.append((self._step_id, planned, speculates))
        return StepPlan(
            step_id=self._step_id,
            new_sequences=tuple(new_sequences),
            chunks=tuple(chunks.values()),
            finished_seq_ids=finished,
            load_loras=loads.take_pending() if chunks or wait_for_loads else (),
            wait_for_loads=wait_for_loads,
        )

    @property
    def waits_for_loads(self) -> bool:
        """Whether some sequence waits for an adapter the workers are reading."""
        return bool(self.lora_loads.loading)

    def can_schedule(self) -> bool:
        """Whether a step may be planned now: fewer are out than the engine runs at once, and
        none of them speculates (what it emits is unknown until it returns)."""
        in_flight = self._in_flight
        return len(in_flight) < self.max_steps_in_flight and not any(entry[2] for entry in in_flight)

    def _chunk(self, seq: Sequence, num_new: int, planned: dict[str, PlannedChunk],
               drafts: tuple[int, ...] = ()) -> ScheduledChunk:
        """The chunk that feeds ``num_new`` tokens (and ``drafts``) to a sequence now, marked
        in flight, with its record in ``planned``."""
        start = seq.num_computed_tokens + seq.num_in_flight_tokens
        end = start + num_new
        token_ids = seq.all_token_ids
        num_known = len(token_ids)
        num_drafts = len(drafts)
        sampled_input = end > num_known  # the token a step in flight samples
        block_ids = seq.block_ids
        new_block_ids: tuple[int, ...] = ()
        if seq.num_blocks_sent < len(block_ids):
            new_block_ids = tuple(block_ids[seq.num_blocks_sent:])
            seq.num_blocks_sent = len(block_ids)
        sample = end == num_known + seq.num_in_flight_samples
        seq.num_in_flight_tokens += num_new + num_drafts
        seq.num_in_flight_samples += sample
        # tuple.__new__ with every field: see worker_messages.records
        planned[seq.seq_id] = tuple.__new__(
            PlannedChunk, (seq, seq.incarnation, start, num_new + num_drafts, sample, num_drafts))
        return tuple.__new__(ScheduledChunk, (seq.seq_id, (*token_ids[start:end], *drafts), start, new_block_ids,
                                              sample, sampled_input, num_drafts, 0))

    def update_from_output(self, result: StepResult) -> list[SequenceUpdate]:
        """Applies a step's result: advances computed tokens, caches newly full blocks, appends
        sampled tokens and runs the token-id stop checks. Finished sequences are freed and
        listed in the next plan's ``finished_seq_ids``. Sequences aborted while the step ran are
        skipped, as are those preempted (their recompute is another incarnation)."""
        poll = result.step_id == self.lora_loads.poll
        failed = self.lora_loads.apply(result)
        aborted = abort_failed_adapters(self, failed) if failed else []
        if poll:
            return aborted
        expected = self._in_flight[0][0] if self._in_flight else None
        if expected != result.step_id:
            if result.step_id == self._step_id and not result.sampled.seq_ids and not result.pooled:
                return []  # the result of a plan without chunks, sent anyway
            raise RuntimeError(f"result of step {result.step_id} does not match the next step in flight "
                               f"({expected})")
        planned = self._in_flight.popleft()[1]
        return aborted + apply_step_result(self, self.speculation, result, planned)

    # ---- state ---------------------------------------------------------------------------

    @property
    def steps_in_flight(self) -> int:
        return len(self._in_flight)

    def statistics(self) -> SchedulerStats:
        bm = self.block_manager
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_preemptions=self.num_preemptions,
            kv_blocks_total=bm.num_blocks,
            kv_blocks_free=bm.num_free_blocks,
            prefix_cache_queries=bm.prefix_cache_queries,
            prefix_cache_hits=bm.prefix_cache_hits,
            iteration_tokens=tuple(self._iteration_tokens),
            iteration_tokens_sum=self._iteration_tokens_sum,
            running_lora_adapters=adapter_names(self.running),
            waiting_lora_adapters=adapter_names(self.waiting),
            spec_decode=self.speculation.statistics() if self.speculation is not None else None,
        )
