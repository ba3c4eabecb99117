"""An in-process worker group for actor tests: steps take simulated time (trio.sleep, so the
mock clock runs them instantly) and faults are injected by the test. As the real group, it
takes plans as they are submitted and runs them one after another in that order, feeding a
plan made ahead the tokens the step before it sampled."""

from __future__ import annotations

import contextlib

import trio

from triode.engine.actors.worker_group import StepTicket, WorkerCrashed
from triode.engine.worker_messages import SampledTokens, StepPlan, StepResult, WorkerInfo


def fake_token(seq_id: str, position: int) -> int:
    """Deterministic 'model': the token at a position depends only on it and the sequence."""
    return 10 + (position * 7 + len(seq_id)) % 50


class _Ticket:
    def __init__(self) -> None:
        self.done = trio.Event()
        self.result_value: StepResult | None = None
        self.error: BaseException | None = None

    async def result(self) -> StepResult:
        await self.done.wait()
        if self.error is not None:
            raise self.error
        return self.result_value


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
        self.last_sampled: dict[str, int] = {}
        self.fed: list[int] = []  # every token a plan made ahead was fed, in order
        self._stepped = trio.Event()
        self._nursery: trio.Nursery | None = None
        self._queue: list[tuple[StepPlan, _Ticket]] = []
        self._work = trio.Event()
        self._generation = 0
        self._running = trio.CancelScope()

    async def next_step(self) -> StepPlan:
        """Waits until the next step starts and returns its plan."""
        await self._stepped.wait()
        return self.plans[-1]

    @contextlib.asynccontextmanager
    async def open(self):
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(self._run)
            yield self
            nursery.cancel_scope.cancel()

    async def load(self) -> WorkerInfo:
        self.loads += 1
        self.known.clear()
        self.last_sampled.clear()
        await trio.sleep(1.0)
        return self.info

    async def kill(self) -> None:
        self._generation += 1
        self._running.cancel()  # the step running now, if any (a hang), is abandoned
        for _, ticket in self._queue:
            ticket.error = WorkerCrashed("the worker group was restarted")
            ticket.done.set()
        self._queue.clear()
        await trio.lowlevel.checkpoint()

    def submit(self, plan: StepPlan) -> StepTicket:
        ticket = _Ticket()
        self._queue.append((plan, ticket))
        self._work.set()
        return ticket.result

    async def _run(self) -> None:
        while True:
            if not self._queue:
                await self._work.wait()
                self._work = trio.Event()
                continue
            plan, ticket = self._queue[0]
            generation = self._generation
            value = None
            with trio.CancelScope() as self._running:
                try:
                    value = await self._execute(plan)
                except Exception as error:
                    ticket.error = error
            if generation != self._generation:
                continue  # killed meanwhile: kill() failed the ticket and emptied the queue
            self._queue.pop(0)
            ticket.result_value = value
            ticket.done.set()

    async def _execute(self, plan: StepPlan) -> StepResult:
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
        for chunk in plan.chunks:
            assert chunk.seq_id in self.known, f"worker does not know {chunk.seq_id}"
            tokens = chunk.token_ids
            if chunk.sampled_input:  # async scheduling: the token this 'model' sampled last
                fed = self.last_sampled[chunk.seq_id]
                assert fed == fake_token(chunk.seq_id, chunk.start_position + len(tokens)), (chunk, fed)
                self.fed.append(fed)
                tokens = (*tokens, fed)
            if chunk.sample:
                position = chunk.start_position + len(tokens)
                token = fake_token(chunk.seq_id, position)
                self.last_sampled[chunk.seq_id] = token
                sampled.append((chunk.seq_id, token))
        return StepResult(step_id=plan.step_id, sampled=SampledTokens(tuple(s for s, _ in sampled),
                                                                      tuple(t for _, t in sampled)))
