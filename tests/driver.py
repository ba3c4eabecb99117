"""A minimal step driver for runner tests: hands out blocks, builds StepPlans, no scheduler."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from triode.engine.lora.request import LoRARequest
from triode.engine.sampling_params import SamplingParams
from triode.engine.worker.runner import ModelRunner
from triode.engine.worker_messages import (
    NewSequence,
    ScheduledChunk,
    StepPlan,
    StepResult,
    TokenLogprobs,
)


def sampled_by_sequence(result: StepResult) -> dict[str, tuple[int, TokenLogprobs | None]]:
    """seq_id -> (token id, logprobs or None) of a step's sampled tokens."""
    sampled = result.sampled
    logprobs = sampled.logprobs or (None,) * len(sampled.seq_ids)
    return {seq_id: (token_id, entry)
            for seq_id, token_id, entry in zip(sampled.seq_ids, sampled.token_ids, logprobs, strict=True)}


class Driver:
    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.next_block = 0
        self.step_ids = itertools.count()
        self.tables: dict[str, list[int]] = {}
        self.sent: dict[str, int] = {}  # how much of each table the worker has seen

    def _blocks_for(self, seq_id: str, num_tokens: int) -> tuple[int, ...]:
        """Grows the table to hold ``num_tokens`` and returns what the worker has not seen."""
        table = self.tables.setdefault(seq_id, [])
        needed = -(-num_tokens // self.runner.block_size) - len(table)
        table.extend(range(self.next_block, self.next_block + max(needed, 0)))
        self.next_block += max(needed, 0)
        unseen = tuple(table[self.sent.get(seq_id, 0):])
        self.sent[seq_id] = len(table)
        return unseen

    def run(self, plan_chunks, new_sequences=()) -> dict[str, tuple[int, TokenLogprobs | None]]:
        plan = StepPlan(step_id=next(self.step_ids), new_sequences=tuple(new_sequences),
                        chunks=tuple(plan_chunks))
        result = self.runner.execute(plan)
        return sampled_by_sequence(result)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        *,
        chunk_size: int | None = None,
        prefix_of: dict[str, tuple[str, int]] | None = None,
        name: str = "seq",
        loras: Sequence[LoRARequest | None] | None = None,
    ) -> list[tuple[list[int], list[TokenLogprobs | None]]]:
        """Prefills every prompt (in chunks of ``chunk_size`` tokens when given), then decodes
        ``params.max_tokens`` tokens for all of them together (``loras``: each prompt's
        adapter). ``prefix_of`` maps a seq id to
        (donor seq id, number of cached tokens) whose blocks it reuses instead of computing."""
        ids = [f"{name}-{i}" for i in range(len(prompts))]
        new = [NewSequence(seq_id=i, prompt_token_ids=tuple(p), params=params, lora=loras[index] if loras else None)
               for index, (i, p) in enumerate(zip(ids, prompts, strict=True))]
        outputs: dict[str, list[int]] = {i: [] for i in ids}
        logprobs: dict[str, list] = {i: [] for i in ids}
        computed = dict.fromkeys(ids, 0)
        for seq_id, (donor, cached) in (prefix_of or {}).items():
            self.tables[seq_id] = self.tables[donor][: cached // self.runner.block_size]
            computed[seq_id] = cached
        pending = list(zip(ids, prompts, strict=True))
        while pending:
            chunks = []
            for seq_id, prompt in pending:
                start = computed[seq_id]
                end = len(prompt) if chunk_size is None else min(len(prompt), start + chunk_size)
                chunks.append(ScheduledChunk(
                    seq_id=seq_id, token_ids=tuple(prompt[start:end]), start_position=start,
                    new_block_ids=self._blocks_for(seq_id, end), sample=end == len(prompt),
                ))
                computed[seq_id] = end
            sampled = self.run(chunks, new)
            new = []
            for seq_id, (token, lp) in sampled.items():
                outputs[seq_id].append(token)
                logprobs[seq_id].append(lp)
            pending = [(s, p) for s, p in pending if computed[s] < len(p)]
        for _ in range(params.max_tokens - 1):
            chunks = []
            for seq_id, prompt in zip(ids, prompts, strict=True):
                position = len(prompt) + len(outputs[seq_id]) - 1
                chunks.append(ScheduledChunk(
                    seq_id=seq_id, token_ids=(outputs[seq_id][-1],), start_position=position,
                    new_block_ids=self._blocks_for(seq_id, position + 1),
                ))
            for seq_id, (token, lp) in self.run(chunks).items():
                outputs[seq_id].append(token)
                logprobs[seq_id].append(lp)
        return [(outputs[i], logprobs[i]) for i in ids]
