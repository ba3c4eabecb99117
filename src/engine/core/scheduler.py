"""Continuous batching in the vLLM v1 style: one token budget per step, no prefill/decode phases.

Each ``schedule()`` hands out up to ``max_num_batched_tokens`` tokens: first to running
sequences (one token for a decode, or the next chunk of an unfinished prefill), then to waiting
ones in policy order (FCFS, or priority then arrival). A sequence's chunk is whatever remains of
its known tokens, cut by the budget and ``long_prefill_token_threshold``; the step samples only
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
(``ScheduledChunk.sampled_input``). Sequence state advances only when
a result arrives, in plan order (``update_from_output``; ``requeue_all_running()`` if the
worker died), so a lost step leaves nothing half-applied. A sequence that finishes, is
aborted or is preempted while a later step for it is out has that step's work ignored (its
``incarnation`` tells a recomputed sequence from the one planned for).

With speculative decoding (``speculation``) a sampling chunk may ask the workers to propose
tokens to follow what it samples (``ScheduledChunk.propose``, as many as the policy finds worth
it); the next step feeds them after the sequence's token (``num_draft_tokens``), and the
result says which the target accepted (``StepResult.accepted``): the sequence grows by those
and the token sampled after them, and only their KV counts as computed. The number of tokens
a speculating step emits is unknown until its result, so no step is planned ahead of one.
"""

from __future__ import annotations

import bisect
import collections
import logging
from collections.abc import Iterable
from typing import NamedTuple

from triode.engine.config import EngineArgs
from triode.engine.core.kv_blocks import BlockManager
from triode.engine.core.lora_loads import LoRALoads
from triode.engine.core.scheduler_output import (
    ITERATION_TOKEN_BUCKETS,
    SchedulerStats,
    SequenceUpdate,
)
from triode.engine.core.sequence import Sequence, SequenceStatus
from triode.engine.errors import InvalidRequestError
from triode.engine.spec_decode.policy import SpeculationPolicy, SpeculationState, speculation_policy
from triode.engine.worker_messages import (
    AcceptedDrafts,
    NewSequence,
    SampledToken,
    ScheduledChunk,
    StepPlan,
    StepResult,
    TokenLogprobs,
)

logger = logging.getLogger(__name__)


class _InFlight(NamedTuple):  # a sequence's share of a step out: a tuple is the cheapest record
    seq: Sequence
    incarnation: int
    start: int
    num_tokens: int
    sample: bool
    num_drafts: int  # of num_tokens, proposed tokens to verify


class Scheduler:
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
        if scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"unknown scheduling policy {scheduling_policy!r}")
        if max_steps_in_flight not in (1, 2):
            raise ValueError(f"max_steps_in_flight must be 1 or 2, got {max_steps_in_flight}")
        self.max_steps_in_flight = max_steps_in_flight
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.long_prefill_token_threshold = None if whole_prompts else long_prefill_token_threshold
        self.scheduling_policy = scheduling_policy
        self.whole_prompts = whole_prompts
        self.max_loras = max_loras
        self.lora_loads = LoRALoads()
        self.speculation = speculation
        self.sequences: dict[str, Sequence] = {}  # every unfinished sequence by seq id
        self.families: dict[str, list[Sequence]] = {}  # user request id -> unfinished sequences
        self.waiting: list[Sequence] = []  # sorted by _key
        self.running: list[Sequence] = []  # in admission order
        self.num_preemptions = 0
        self._next_order = 0
        self._step_id = 0
        # Each step out (plan order): its id, its sequences' shares, and whether it speculates
        # (verifies or asks for proposed tokens: what it emits is known only from its result).
        self._in_flight: collections.deque[tuple[int, dict[str, _InFlight], bool]] = collections.deque()
        self._finished_seq_ids: list[str] = []  # the worker must forget these
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

    def _key(self, seq: Sequence) -> tuple[float, ...]:
        """Importance order, smallest first: admission follows it, preemption reverses it."""
        if self.scheduling_policy == "priority":
            return (seq.priority, seq.arrival_time, seq.order)
        return (seq.arrival_time, seq.order)

    # ---- requests in and out -------------------------------------------------------------

    def add_sequence(self, seq: Sequence) -> None:
        """Queues a sequence (the engine core has checked its id). Raises
        ``InvalidRequestError`` for one that could not fit in the whole KV cache even alone
        (see ``check_fits``)."""
        self.check_fits(seq)
        seq.order = self._next_order
        self._next_order += 1
        self.sequences[seq.seq_id] = seq
        self.families.setdefault(seq.request_id, []).append(seq)
        self._enqueue(seq)
        if seq.lora is not None:
            self.lora_loads.request(seq.lora)

    def check_fits(self, seq: Sequence) -> None:
        """Raises ``InvalidRequestError`` for a sequence that could not fit in the whole KV
        cache even alone: admitting it would deadlock the scheduler."""
        bm = self.block_manager
        # The last sampled token is never fed, so at most max_num_tokens - 1 positions hold KV.
        if bm.blocks_in_use_at_most(seq.max_num_tokens - 1, self.max_num_batched_tokens) > bm.num_blocks:
            capacity = bm.num_blocks * bm.block_size
            field = "prompt" if seq.num_prompt_tokens > capacity else "max_tokens"
            raise InvalidRequestError(
                f"{field}: the request may grow to {seq.max_num_tokens} tokens but the KV "
                f"cache holds only {capacity}",
                field=field,
            )

    def _enqueue(self, seq: Sequence) -> None:
        bisect.insort(self.waiting, seq, key=self._key)

    def abort(self, ids: Iterable[str]) -> list[Sequence]:
        """Aborts sequences, by sequence id or by user request id (all its sequences). Their
        blocks are free at once and their ids go to the next plan's ``finished_seq_ids``.
        Unknown or already finished ids are ignored: aborts race with normal completion."""
        return self.finish(ids, SequenceStatus.FINISHED_ABORTED)

    def finish(
        self,
        ids: Iterable[str],
        status: SequenceStatus = SequenceStatus.FINISHED_STOPPED,
        stop_reason: int | str | None = None,
    ) -> list[Sequence]:
        """Finishes sequences from outside the scheduler, e.g. on a stop string found by the
        detokenizer (``stop_reason`` = the string). Ids as for ``abort``."""
        assert status.is_finished
        finished = []
        for an_id in ids:
            seq = self.sequences.get(an_id)
            family = [seq] if seq is not None else self.families.get(an_id, [])
            for member in list(family):
                member.stop_reason = stop_reason
                self._finish(member, status)
                finished.append(member)
        return finished

    def _finish(self, seq: Sequence, status: SequenceStatus) -> None:
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = status
        del self.sequences[seq.seq_id]
        family = self.families[seq.request_id]
        family.remove(seq)
        if not family:
            del self.families[seq.request_id]
        if seq.known_to_worker:
            self._finished_seq_ids.append(seq.seq_id)

    def _preempt(self, seq: Sequence) -> None:
        """Recompute later: free everything now, back to the waiting queue in key order (the
        front, unless more important requests wait)."""
        self.block_manager.free(seq)
        if seq.known_to_worker:
            self._finished_seq_ids.append(seq.seq_id)
        seq.reset_for_recompute()
        self._enqueue(seq)

    def requeue_all_running(self) -> list[Sequence]:
        """After a worker restart: every running sequence lost its KV and is recomputed (not
        counted as a preemption); the in-flight step is dropped; the prefix cache is emptied,
        since it named KV of the dead worker; the next plan assumes the worker knows nothing."""
        requeued = self.running
        self.running = []
        for seq in requeued:
            self.block_manager.free(seq)
            seq.reset_for_recompute()
            self._enqueue(seq)
        self._in_flight.clear()
        self._finished_seq_ids = []
        self.block_manager.reset_prefix_cache()
        self.lora_loads.reset()
        for seq in self.waiting:
            if seq.lora is not None:
                self.lora_loads.request(seq.lora)
        return requeued

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
        planned: dict[str, _InFlight] = {}  # each chunk's record, kept until its result
        new_sequences: list[NewSequence] = []
        preempted = False

        # Running sequences first: decodes and unfinished prefills, in admission order. This
        # loop runs for every sequence of every step: it reads plain attributes, and asks the
        # block manager only when the sequence's last block lacks room.
        block_size = bm.block_size
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = self._num_to_schedule(seq, min(threshold, budget))
            if num_new == 0:
                i += 1
                continue
            drafts = self._drafts_to_verify(seq, budget - num_new) if seq.draft_token_ids else ()
            needed = num_new + len(drafts)
            fits = seq.num_computed_tokens + seq.num_in_flight_tokens + needed <= len(seq.block_ids) * block_size
            while not fits and bm.allocate_slots(seq, needed) is None:
                victim = max(self.running, key=self._key)
                position = self.running.index(victim)
                del self.running[position]
                if victim.seq_id in chunks:
                    budget += chunks.pop(victim.seq_id).num_tokens
                    del planned[victim.seq_id]
                self._preempt(victim)
                self.num_preemptions += 1
                preempted = True
                if victim is seq:
                    break
                if position < i:
                    i -= 1
            else:
                chunks[seq.seq_id] = self._chunk(seq, num_new, planned, drafts)
                budget -= needed
                i += 1

        # Then waiting ones, unless this step had to preempt (they would only thrash).
        if not preempted:
            # the adapters of the running sequences (none to count on an engine without LoRA)
            adapters = {s.lora.lora_int_id for s in self.running if s.lora is not None} if self.max_loras else set()
            slot_wanted = False  # a sequence waits for an adapter's slot: no adapter's sequence passes it
            for seq in list(self.waiting):
                if len(self.running) >= self.max_num_seqs or budget == 0:
                    break
                if self._sibling_is_prefilling(seq):
                    continue  # share its prompt blocks once they are cached
                if seq.lora is not None:
                    if seq.lora.lora_int_id not in self.lora_loads.ready:
                        self.lora_loads.request(seq.lora)  # again, if the workers dropped it
                        continue  # while its adapter is read
                    if slot_wanted:
                        continue  # a sequence before it waits for a slot
                    if seq.lora.lora_int_id not in adapters and len(adapters) >= (self.max_loras or 0):
                        slot_wanted = True
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
                    adapters.add(seq.lora.lora_int_id)
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
            self._ask_for_proposals(chunks)
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

    def _abort_adapters(self, failed: dict[int, str]) -> list[SequenceUpdate]:
        """Ends every sequence of adapters the workers could not read (their files changed
        since the engine checked them), each with a final "abort" update."""
        ended = [(seq, seq.lora) for seq in self.sequences.values()
                 if seq.lora is not None and seq.lora.lora_int_id in failed]
        for seq, lora in ended:
            logger.error("LoRA adapter %r could not be read by the workers (%s): request %r aborted",
                         lora.lora_name, failed[lora.lora_int_id], seq.request_id)
        self.finish([seq.seq_id for seq, _ in ended], SequenceStatus.FINISHED_ABORTED)
        return [SequenceUpdate(seq.seq_id, seq.request_id, seq.index, finish_reason="abort",
                               num_cached_tokens=seq.num_cached_tokens) for seq, _ in ended]

    @staticmethod
    def _num_to_schedule(seq: Sequence, limit: int) -> int:
        """The tokens to feed a running sequence now, at most ``limit``: the rest of those it
        has (with the one a step in flight samples), or none if that step ends it by length."""
        # Plain attributes rather than Sequence's properties: this runs for every sequence of
        # every step.
        pending = seq.num_in_flight_samples
        num_tokens = len(seq.all_token_ids)
        if pending and num_tokens + pending >= seq.max_num_tokens:
            return 0
        return min(num_tokens + pending - seq.num_computed_tokens - seq.num_in_flight_tokens, limit)

    def _drafts_to_verify(self, seq: Sequence, budget: int) -> tuple[int, ...]:
        """The proposed tokens a decode feeds after its token: as many as the budget and the
        tokens the sequence may still emit leave room for (one more always comes with them)."""
        drafts, seq.draft_token_ids = seq.draft_token_ids, ()
        if seq.num_in_flight_samples:  # cannot happen: no step is planned ahead of a proposal
            return ()
        return drafts[:max(0, min(budget, seq.max_num_tokens - len(seq.all_token_ids) - 1))]

    def _ask_for_proposals(self, chunks: dict[str, ScheduledChunk]) -> None:
        """Marks the sampling chunks whose sequences should propose tokens for their next step."""
        policy = self.speculation
        assert policy is not None
        if not policy.batch_speculates(len(self.running)):
            return
        sequences = self.sequences
        for seq_id, chunk in chunks.items():
            if not chunk.sample:
                continue
            seq = sequences[seq_id]
            # the step emits at least one token; the next one at least one more
            room = seq.max_num_tokens - len(seq.all_token_ids) - seq.num_in_flight_samples - 1
            if seq.speculation is None:
                seq.speculation = SpeculationState()
            if k := policy.tokens_to_propose(seq.speculation, room):
                chunks[seq_id] = chunk._replace(propose=k)

    def can_schedule(self) -> bool:
        """Whether a step may be planned now: fewer are out than the engine runs at once, and
        none of them speculates (what it emits is unknown until it returns)."""
        in_flight = self._in_flight
        return len(in_flight) < self.max_steps_in_flight and not any(entry[2] for entry in in_flight)

    def _chunk(self, seq: Sequence, num_new: int, planned: dict[str, _InFlight],
               drafts: tuple[int, ...] = ()) -> ScheduledChunk:
        """The chunk that feeds ``num_new`` tokens (and ``drafts``) to a sequence now, marked
        in flight, with its record in ``planned``."""
        start = seq.num_computed_tokens + seq.num_in_flight_tokens
        end = start + num_new
        token_ids = seq.all_token_ids
        sampled_input = end > len(token_ids)  # the token a step in flight samples
        block_ids = seq.block_ids
        new_block_ids: tuple[int, ...] = ()
        if seq.num_blocks_sent < len(block_ids):
            new_block_ids = tuple(block_ids[seq.num_blocks_sent:])
            seq.num_blocks_sent = len(block_ids)
        sample = end == len(token_ids) + seq.num_in_flight_samples
        seq.num_in_flight_tokens += num_new + len(drafts)
        seq.num_in_flight_samples += sample
        planned[seq.seq_id] = _InFlight(seq, seq.incarnation, start, num_new + len(drafts), sample, len(drafts))
        return ScheduledChunk(seq.seq_id, (*token_ids[start:end], *drafts), start, new_block_ids, sample,
                              sampled_input, len(drafts))

    def _sibling_is_prefilling(self, seq: Sequence) -> bool:
        """True while another sequence of the same n > 1 request still computes the prompt's
        full blocks. With prefix caching this one then reuses them instead of recomputing."""
        bm = self.block_manager
        if (
            not bm.enable_prefix_caching
            or seq.params.prompt_logprobs is not None  # never reads the cache
        ):
            return False
        shared_tokens = (seq.num_prompt_tokens - 1) // bm.block_size * bm.block_size
        return any(
            other.status == SequenceStatus.RUNNING and other.num_computed_tokens < shared_tokens
            for other in self.families[seq.request_id]
            if other is not seq
        )

    def update_from_output(self, result: StepResult) -> list[SequenceUpdate]:
        """Applies a step's result: advances computed tokens, caches newly full blocks, appends
        sampled tokens and runs the token-id stop checks. Finished sequences are freed and
        listed in the next plan's ``finished_seq_ids``. Sequences aborted while the step ran are
        skipped, as are those preempted (their recompute is another incarnation)."""
        poll = result.step_id == self.lora_loads.poll
        failed = self.lora_loads.apply(result)
        aborted = self._abort_adapters(failed) if failed else []
        if poll:
            return aborted
        expected = self._in_flight[0][0] if self._in_flight else None
        if expected != result.step_id:
            if result.step_id == self._step_id and not result.sampled and not result.pooled:
                return []  # the result of a plan without chunks, sent anyway
            raise RuntimeError(f"result of step {result.step_id} does not match the next step in flight "
                               f"({expected})")
        in_flight = self._in_flight.popleft()[1]
        sampled = {token.seq_id: token for token in result.sampled}
        accepted = {entry.seq_id: entry for entry in result.accepted}
        proposals = dict(result.proposals)
        pooled = dict(result.pooled)
        prompt_logprobs = dict(result.prompt_logprobs)
        # This loop runs for every sequence of every step: what it can, it looks up once.
        bm = self.block_manager
        cache_blocks = bm.cache_computed_blocks if bm.enable_prefix_caching else None
        block_size = bm.block_size
        release_blocks = bm.release_outside_window if bm.sliding_window is not None else None
        sequences = self.sequences
        updates = aborted
        for seq_id, step in in_flight.items():
            seq = step.seq
            if sequences.get(seq_id) is not seq or seq.incarnation != step.incarnation:
                continue  # finished, aborted or preempted after the plan was made
            seq.num_computed_tokens += step.num_tokens - step.num_drafts
            seq.num_in_flight_tokens -= step.num_tokens
            # a verified chunk's blocks: once its accepted tokens are appended (_apply_verified);
            # the test before the call skips it for the steps that fill no block
            if cache_blocks is not None and not step.num_drafts and \
                    seq.num_computed_tokens >= (seq.num_cached_blocks + 1) * block_size:
                cache_blocks(seq)
            if release_blocks is not None and not step.num_drafts:
                release_blocks(seq)
            plp = seq.unsent_prompt_logprobs(step.start, prompt_logprobs[seq_id]) if seq_id in prompt_logprobs else ()
            if not step.sample:
                if plp:
                    updates.append(SequenceUpdate(seq_id, seq.request_id, seq.index, (), (), plp,
                                                  None, None, seq.num_cached_tokens))
                continue
            seq.num_in_flight_samples -= 1
            if seq.pooling is not None:  # its prompt has run: its embedding is its result
                if seq_id not in pooled:
                    raise RuntimeError(f"step {result.step_id} pooled nothing for {seq_id!r}")
                self._finish(seq, SequenceStatus.FINISHED_STOPPED)
                updates.append(SequenceUpdate(seq_id, seq.request_id, seq.index, finish_reason="stop",
                                              num_cached_tokens=seq.num_cached_tokens, embedding=pooled[seq_id]))
                continue
            token = sampled.get(seq_id)
            if token is None:
                raise RuntimeError(f"step {result.step_id} sampled no token for {seq_id!r}")
            if step.num_drafts:
                new_ids, logprobs, status = self._apply_verified(seq, step.num_drafts, accepted.get(seq_id), token)
            else:
                seq.all_token_ids.append(token.token_id)  # append_output_token, without the call
                status = seq.check_stop()
                new_ids, logprobs = (token.token_id,), (token.logprobs,)
            if status is not None:
                self._finish(seq, status)
            elif seq_id in proposals:
                seq.draft_token_ids = proposals[seq_id]
            updates.append(SequenceUpdate(
                seq_id, seq.request_id, seq.index, new_ids,
                logprobs if seq.params.logprobs is not None else (), plp,
                None if status is None else status.finish_reason,
                None if status is None else seq.stop_reason, seq.num_cached_tokens,
            ))
        return updates

    def _apply_verified(
        self, seq: Sequence, num_drafts: int, accepted: AcceptedDrafts | None, token: SampledToken,
    ) -> tuple[tuple[int, ...], tuple[TokenLogprobs | None, ...], SequenceStatus | None]:
        """Appends a verified chunk's accepted tokens and the one sampled after them, up to a
        stop; their KV, but the last token's, is now computed. Returns (tokens, logprobs,
        finished status or None)."""
        ids = (*accepted.token_ids, token.token_id) if accepted else (token.token_id,)
        # (the accepted tokens' logprobs are empty where the request asked for none; unread then)
        logprobs = (*accepted.logprobs, token.logprobs) if accepted else (token.logprobs,)
        assert self.speculation is not None and seq.speculation is not None
        self.speculation.record(seq.speculation, num_drafts, len(ids) - 1)
        status = None
        kept = 0
        for token_id in ids:
            seq.append_output_token(token_id)
            kept += 1
            if (status := seq.check_stop()) is not None:
                break
        seq.num_computed_tokens += kept - 1
        bm = self.block_manager
        if bm.enable_prefix_caching:
            bm.cache_computed_blocks(seq)
        if bm.sliding_window is not None:
            bm.release_outside_window(seq)
        return ids[:kept], logprobs[:kept], status

    # ---- state ---------------------------------------------------------------------------

    def has_unfinished_requests(self) -> bool:
        return bool(self.sequences)

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
            running_lora_adapters=_adapter_names(self.running),
            waiting_lora_adapters=_adapter_names(self.waiting),
            spec_decode=self.speculation.statistics() if self.speculation is not None else None,
        )


def _adapter_names(sequences: list[Sequence]) -> tuple[str, ...]:
    return tuple(sorted({seq.lora.lora_name for seq in sequences if seq.lora is not None}))
