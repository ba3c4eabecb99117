"""The sequences a worker holds, kept in step with the engine's plans, and a step's chunks put
in the order its ops batch them.

Before a step runs, its plan's finished ids are forgotten everywhere a sequence left state
(block table, grammar, pooler, proposer), and its new sequences are added: a sequence that
restarts (preempted, or after a worker restart) comes back as new, with everything to
recompute, so whatever was kept of its earlier run is dropped first. A plan made ahead (async
scheduling) feeds a sequence the token the step before sampled (``sampled_input``), which the
engine did not know when it sent the plan: this worker sampled it, and ran that step first.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Protocol

from triode.engine.lora.request import LoRARequest
from triode.engine.worker.block_tables import BlockTables
from triode.engine.worker.grammar import SequenceGrammars
from triode.engine.worker.row_sampling import WorkerSequence
from triode.engine.worker_messages import ScheduledChunk, StepPlan

__all__ = ["SequenceTable", "batch_order"]


class _KeepsSequenceState(Protocol):
    def forget(self, seq_id: str) -> None: ...


class SequenceTable:
    def __init__(self, block_tables: BlockTables, *, grammars: SequenceGrammars | None,
                 keepers: Sequence[_KeepsSequenceState | None], proposer: _KeepsSequenceState | None) -> None:
        """``keepers``: what else keeps state per sequence (the pooler, the proposer; None for
        what this rank lacks); ``proposer``: the proposer, whose state for a restarting
        sequence is stale."""
        self.sequences: dict[str, WorkerSequence] = {}
        self.block_tables = block_tables
        self._grammars = grammars
        self._keepers = [keeper for keeper in (grammars, *keepers) if keeper is not None]
        self._proposer = proposer

    def apply(self, plan: StepPlan) -> float:
        """Forgets the plan's finished sequences and adds its new ones. Returns the seconds
        spent starting grammars (a step's ``grammar_seconds``)."""
        for seq_id in plan.finished_seq_ids:
            self.sequences.pop(seq_id, None)
            self.block_tables.remove(seq_id)
            for keeper in self._keepers:
                keeper.forget(seq_id)
        grammar_seconds = 0.0
        for new in plan.new_sequences:
            if self._proposer is not None:
                self._proposer.forget(new.seq_id)
            self.sequences[new.seq_id] = WorkerSequence(
                list(new.prompt_token_ids), list(new.output_token_ids), new.params, new.eos_token_ids, new.pooling,
                new.lora,
            )
            self.block_tables.add(new.seq_id)
            if self._grammars is not None and new.params.structured_outputs is not None:
                started = time.perf_counter()
                self._grammars.start(new.seq_id, new.params.structured_outputs, new.eos_token_ids,
                                     new.output_token_ids)
                grammar_seconds += time.perf_counter() - started
        return grammar_seconds

    def chunk_tokens(self, chunks: Sequence[ScheduledChunk]) -> list[tuple[int, ...]]:
        """Every chunk's input tokens, with the token sampled for it by the step before where the
        plan was made ahead."""
        sequences = self.sequences
        return [(*chunk.token_ids, sequences[chunk.seq_id].output_token_ids[-1]) if chunk.sampled_input
                else chunk.token_ids for chunk in chunks]

    def adapters(self, chunks: Sequence[ScheduledChunk]) -> list[LoRARequest | None] | None:
        """Each chunk's adapter, or None when no chunk of the step has one."""
        adapters = [self.sequences[chunk.seq_id].lora for chunk in chunks]
        return adapters if any(adapters) else None


def batch_order(
    chunks: Sequence[ScheduledChunk], chunk_tokens: list[tuple[int, ...]], adapters: list[LoRARequest | None] | None,
) -> tuple[Sequence[ScheduledChunk], list[tuple[int, ...]], list[LoRARequest | None] | None]:
    """The step's chunks (with their tokens and adapters) in the order its ops batch them:
    decodes (one query token) first, which the attention ops run together; then each adapter's
    rows together, the segments of the LoRA op. Unchanged when every chunk decodes without an
    adapter, the common step."""
    if adapters is None and all(len(tokens) == 1 for tokens in chunk_tokens):
        return chunks, chunk_tokens, adapters
    ids = [0 if adapter is None else adapter.lora_int_id for adapter in adapters] if adapters else None
    order = sorted(range(len(chunks)), key=lambda i: (len(chunk_tokens[i]) != 1, ids[i] if ids else 0))
    return ([chunks[i] for i in order], [chunk_tokens[i] for i in order],
            [adapters[i] for i in order] if adapters is not None else None)
