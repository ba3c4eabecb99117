"""An in-process worker group for actor tests: steps take simulated time (trio.sleep, so the
mock clock runs them instantly) and faults are injected by the test."""

from __future__ import annotations

import contextlib

import trio

from engine.actors.workers import WorkerCrashed
from engine.worker_messages import SampledToken, StepPlan, StepResult, WorkerInfo


def fake_token(seq_id: str, position: int) -> int:
    """Deterministic 'model': the token at a position depends only on it and the sequence."""
    return 10 + (position * 7 + len(seq_id)) % 50


class FakeWorkerGroup:
    def __init__(self, *, num_blocks: int = 64, block_size: int = 16, step_seconds: float = 0.05,
                 max_model_len: int = 256, vocab_size: int = 400) -> None:
        self.info = WorkerInfo(
            pid=0, num_blocks=num_blocks, block_size=block_size, max_model_len=max_model_len,
            vocab_size=vocab_size, dtype="float32", device="cpu", load_seconds=0.0,
        )
        self.step_seconds = step_seconds
        self.pids = (0,)
        self.loads = 0
        self.steps = 0
        self.plans: list[StepPlan] = []
        self.faults: list[str] = []  # "hang" / "crash" / "raise", consumed one per step
        self.known: set[str] = set()
        self._stepped = trio.Event()

    async def next_step(self) -> StepPlan:
        """Waits until the next step starts and returns its plan."""
        await self._stepped.wait()
        return self.plans[-1]

    @contextlib.asynccontextmanager
    async def open(self):
        yield self

    async def load(self) -> WorkerInfo:
        self.loads += 1
        self.known.clear()
        await trio.sleep(1.0)
        return self.info

    async def kill(self) -> None:
        await trio.lowlevel.checkpoint()

    async def execute(self, plan: StepPlan) -> StepResult:
        self.plans.append(plan)
        self.steps += 1
        self._stepped.set()
        self._stepped = trio.Event()
        fault = self.faults.pop(0) if self.faults else None
        if fault == "hang":
            await trio.sleep_forever()
        await trio.sleep(self.step_seconds)
        if fault == "crash":
            raise WorkerCrashed("fake worker died", -9)
        if fault == "raise":
            raise RuntimeError("injected fault in the model forward")
        self.known.difference_update(plan.finished_seq_ids)
        self.known.update(s.seq_id for s in plan.new_sequences)
        sampled = []
        for chunk, tokens in zip(plan.chunks, plan.chunk_token_ids(), strict=True):
            assert chunk.seq_id in self.known, f"worker does not know {chunk.seq_id}"
            if chunk.sampled_input:  # async scheduling: the token this 'model' sampled last
                assert tokens[-1] == fake_token(chunk.seq_id, chunk.start_position), (chunk, tokens)
            if chunk.sample:
                position = chunk.start_position + len(tokens)
                sampled.append(SampledToken(seq_id=chunk.seq_id, token_id=fake_token(chunk.seq_id, position)))
        return StepResult(step_id=plan.step_id, sampled=tuple(sampled))
