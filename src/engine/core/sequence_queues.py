"""The sequences a scheduler holds and where each one is: waiting in importance order, running
in admission order, by sequence id and by the user's request id (all n outputs of one
request), and the ids the workers must forget in the next plan.

Importance is FCFS (arrival) or priority then arrival; admission follows it and preemption
reverses it. A sequence enters only if it could fit in the whole KV cache alone, so the most
important one always progresses. Finishing, preempting and a worker's restart free a
sequence's blocks at once; planning is the ``Scheduler``'s (``core.scheduler``), which builds
on these queues.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable

from triode.engine.core.kv_blocks import BlockManager
from triode.engine.core.lora_loads import LoRALoads
from triode.engine.core.sequence import Sequence, SequenceStatus
from triode.engine.errors import InvalidRequestError


class SequenceQueues:
    def __init__(self, block_manager: BlockManager, *, max_num_batched_tokens: int,
                 scheduling_policy: str = "fcfs") -> None:
        if scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"unknown scheduling policy {scheduling_policy!r}")
        self.block_manager = block_manager
        self.max_num_batched_tokens = max_num_batched_tokens
        self.scheduling_policy = scheduling_policy
        self.lora_loads = LoRALoads()
        self.sequences: dict[str, Sequence] = {}  # every unfinished sequence by seq id
        self.families: dict[str, list[Sequence]] = {}  # user request id -> unfinished sequences
        self.waiting: list[Sequence] = []  # sorted by _key
        self.running: list[Sequence] = []  # in admission order
        self.num_preemptions = 0
        self._next_order = 0
        self._finished_seq_ids: list[str] = []  # the worker must forget these

    def _key(self, seq: Sequence) -> tuple[float, ...]:
        """Importance order, smallest first: admission follows it, preemption reverses it."""
        if self.scheduling_policy == "priority":
            return (seq.priority, seq.arrival_time, seq.order)
        return (seq.arrival_time, seq.order)

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
                self.retire(member, status)
                finished.append(member)
        return finished

    def retire(self, seq: Sequence, status: SequenceStatus) -> None:
        """Gives a sequence its finished status and frees everything it holds."""
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
        front, unless more important requests wait). The caller has taken it off ``running``."""
        self.block_manager.free(seq)
        if seq.known_to_worker:
            self._finished_seq_ids.append(seq.seq_id)
        seq.reset_for_recompute()
        self._enqueue(seq)
        self.num_preemptions += 1

    def requeue_all_running(self) -> list[Sequence]:
        """After a worker restart: every running sequence lost its KV and is recomputed (not
        counted as a preemption); the prefix cache is emptied, since it named KV of the dead
        worker; the next plan assumes the worker knows nothing."""
        requeued = self.running
        self.running = []
        for seq in requeued:
            self.block_manager.free(seq)
            seq.reset_for_recompute()
            self._enqueue(seq)
        self._finished_seq_ids = []
        reset = self.block_manager.reset_prefix_cache()
        assert reset, "every block is free once every running sequence is"
        self.lora_loads.reset()
        for seq in self.waiting:
            if seq.lora is not None:
                self.lora_loads.request(seq.lora)
        return requeued

    def sibling_is_prefilling(self, seq: Sequence) -> bool:
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

    def has_unfinished_requests(self) -> bool:
        return bool(self.sequences)


def adapter_names(sequences: list[Sequence]) -> tuple[str, ...]:
    """The LoRA adapters of ``sequences``, by name (what vllm:lora_requests_info lists)."""
    return tuple(sorted({seq.lora.lora_name for seq in sequences if seq.lora is not None}))
