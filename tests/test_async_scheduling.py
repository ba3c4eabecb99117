"""Unit tests: async scheduling in the sans-IO scheduler and engine core (no event loop).

Plans are made while the step before them is out, fed the token that step sampled by the
simulated worker of test_core_scheduler (as the real worker feeds them), which holds every
plan against the KV it wrote. A deterministic fake model (each token a function
of the sequence so far, as greedy decoding is) makes outputs comparable across sync and async
runs: they must be identical, aborts, stop strings, EOS, preemption and restarts included.
"""

from __future__ import annotations

import collections
import random

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.test_core_scheduler import (
    ADD_OP,
    EOS,
    FakeWorker,
    check_invariants,
    check_plan,
    make_scheduler,
)
from triode.engine.config import EngineArgs
from triode.engine.core.engine_core import EngineCore
from triode.engine.core.scheduler import Scheduler
from triode.engine.core.sequence import Sequence, SequenceStatus, make_sequences
from triode.engine.errors import InvalidRequestError
from triode.engine.sampling_params import SamplingParams
from triode.engine.worker_messages import SampledTokens, StepPlan, StepResult


def _greedy_token(tokens: list[int], vocab: int) -> int:
    return (sum(t * (i + 3) for i, t in enumerate(tokens)) + 7 * len(tokens)) % vocab


class Pipeline:
    """Drives a scheduler as the engine does: at most ``max_steps_in_flight`` plans out, each
    run in order by the worker, which feeds a plan made ahead the tokens it sampled."""

    def __init__(self, scheduler: Scheduler, worker: FakeWorker) -> None:
        self.scheduler = scheduler
        self.worker = worker
        self.out: collections.deque[tuple[StepPlan, bool]] = collections.deque()
        self.last_result: StepResult | None = None
        self.plans_ahead = 0

    def plan(self) -> bool:
        scheduler = self.scheduler
        if scheduler.steps_in_flight >= scheduler.max_steps_in_flight or not scheduler.has_unfinished_requests():
            return False
        plan = scheduler.schedule()
        check_plan(scheduler, plan)
        check_invariants(scheduler)
        if not plan.chunks:
            assert self.out, "unfinished requests, nothing out and nothing scheduled: deadlock"
            return False
        ahead = bool(self.out)
        self.plans_ahead += ahead
        if not ahead:
            assert not any(chunk.sampled_input for chunk in plan.chunks)
        self.out.append((plan, ahead))
        return True

    def complete(self) -> None:
        plan, _ = self.out.popleft()
        self.last_result = self.worker.run(plan)
        self.scheduler.update_from_output(self.last_result)
        check_invariants(self.scheduler)

    def crash(self) -> None:
        """The workers died with everything out: every running sequence is recomputed."""
        self.out.clear()
        self.scheduler.requeue_all_running()
        self.worker.restart()
        check_invariants(self.scheduler)

    def drain(self, max_steps: int = 3000) -> None:
        for _ in range(max_steps):
            while self.plan():
                pass
            if not self.out:
                break
            self.complete()
        assert not self.scheduler.has_unfinished_requests(), "requests did not finish"
        assert self.scheduler.steps_in_flight == 0
        stats = self.scheduler.statistics()
        assert stats.kv_blocks_free == stats.kv_blocks_total


def greedy_worker(num_blocks: int, block_size: int, *, window: int | None = None, vocab: int = 6,
                  max_discarded: int = 1) -> FakeWorker:
    """A FakeWorker whose samples depend on each sequence's tokens only."""
    worker = FakeWorker(num_blocks, block_size, window=window, vocab=vocab, max_discarded=max_discarded)
    run = worker.run

    def run_greedy(plan: StepPlan) -> StepResult:
        for new in plan.new_sequences:
            worker.forced.pop(new.seq_id, None)
        histories = {}
        for new in plan.new_sequences:
            histories[new.seq_id] = [*new.prompt_token_ids, *new.output_token_ids]
        for chunk in plan.chunks:
            if chunk.sample:
                seq = worker.seqs.get(chunk.seq_id)
                known = histories.get(chunk.seq_id, seq.tokens if seq is not None else [])
                end = chunk.start_position + len(chunk.token_ids)
                fed = known[end:end + 1] if chunk.sampled_input else []  # what the worker feeds
                history = [*known[: chunk.start_position], *chunk.token_ids, *fed]
                worker.forced[chunk.seq_id] = [_greedy_token(history, worker.vocab)]
        return run(plan)

    worker.run = run_greedy
    return worker


# ---- the plan made ahead --------------------------------------------------------------------


def _request(request_id: str, prompt: list[int], **params) -> Sequence:
    params.setdefault("ignore_eos", True)
    return Sequence(request_id, prompt, SamplingParams(**params), arrival_time=0.0, max_model_len=64,
                   eos_token_ids=(EOS,))


def test_a_plan_made_ahead_feeds_the_token_in_flight():
    scheduler = make_scheduler(num_blocks=8, block_size=4, max_steps_in_flight=2)
    scheduler.add_sequence(_request("a", [1, 2, 3], max_tokens=4))
    first = scheduler.schedule()
    ahead = scheduler.schedule()
    (chunk,) = ahead.chunks
    assert (chunk.token_ids, chunk.start_position, chunk.sampled_input, chunk.sample) == ((), 3, True, True)
    with pytest.raises(RuntimeError, match="steps in flight"):
        scheduler.schedule()  # two out at most
    worker = FakeWorker(8, 4, max_discarded=1)
    first_result = worker.run(first)
    second_result = worker.run(ahead)  # fed the token the worker sampled in the first step
    assert worker.seqs["a"].tokens[3] == first_result.sampled.token_ids[0]
    scheduler.update_from_output(first_result)
    scheduler.update_from_output(second_result)
    assert scheduler.sequences["a"].num_output_tokens == 2


def test_results_must_come_back_in_plan_order():
    scheduler = make_scheduler(max_steps_in_flight=2)
    scheduler.add_sequence(_request("a", [1, 2, 3]))
    first, ahead = scheduler.schedule(), scheduler.schedule()
    with pytest.raises(RuntimeError, match="does not match the next step in flight"):
        scheduler.update_from_output(StepResult(step_id=ahead.step_id, sampled=SampledTokens(("a",), (1,))))
    assert first.step_id < ahead.step_id


def test_a_sequence_the_step_in_flight_ends_is_not_planned_again():
    scheduler = make_scheduler(max_steps_in_flight=2)
    scheduler.add_sequence(_request("short", [1, 2], max_tokens=1))
    scheduler.add_sequence(_request("long", [3, 4], max_tokens=5))
    scheduler.schedule()
    ahead = scheduler.schedule()
    assert [c.seq_id for c in ahead.chunks] == ["long"]  # no wasted step for "short"


def test_the_core_plans_ahead_only_when_there_is_something_to_plan():
    args = EngineArgs(async_scheduling=True)
    core = EngineCore(Scheduler.from_engine_args(args, num_blocks=16), max_model_len=64, eos_token_ids=[EOS])
    core.add_request("a", [1, 2, 3], SamplingParams(max_tokens=1), arrival_time=0.0)
    assert core.can_schedule()
    assert core.schedule(0.0) is not None
    assert core.can_schedule() and core.steps_in_flight == 1
    assert core.schedule(0.0) is None  # the step out ends the only request


def test_async_scheduling_is_on_for_gpu_workers_unless_set():
    assert EngineArgs().async_scheduling_on("cuda:0") and not EngineArgs().async_scheduling_on("cpu")
    assert EngineArgs(async_scheduling=True).async_scheduling_on("cpu")
    assert not EngineArgs(async_scheduling=False).async_scheduling_on("cuda:0")
    assert Scheduler.from_engine_args(EngineArgs(), num_blocks=4, worker_device="cuda:0").max_steps_in_flight == 2
    assert Scheduler.from_engine_args(EngineArgs(), num_blocks=4).max_steps_in_flight == 1
    assert EngineArgs.from_env({"TRIODE_ASYNC_SCHEDULING": "1"}).async_scheduling is True


def test_an_abort_while_two_steps_are_out_ignores_both():
    scheduler = make_scheduler(max_steps_in_flight=2)
    scheduler.add_sequence(_request("a", [1, 2, 3], max_tokens=8))
    scheduler.add_sequence(_request("b", [1, 2, 4], max_tokens=8))
    pipeline = Pipeline(scheduler, FakeWorker(16, 4, max_discarded=1))
    assert pipeline.plan() and pipeline.plan()
    scheduler.abort(["a"])
    assert scheduler.block_manager.num_free_blocks > 0
    pipeline.complete()
    pipeline.complete()
    assert "a" not in scheduler.sequences and scheduler.sequences["b"].num_output_tokens == 2
    assert pipeline.plan()
    assert "a" in pipeline.out[-1][0].finished_seq_ids
    pipeline.drain()


def test_a_preemption_while_a_step_is_out_recomputes_without_its_token():
    # Two sequences that cannot both grow: planning ahead preempts one of them while the step
    # in flight still computes it; that step's work for it is then ignored.
    outputs = {}
    for steps_in_flight in (1, 2):
        scheduler = make_scheduler(num_blocks=3, block_size=2, max_steps_in_flight=steps_in_flight)
        requests = [_request("a", [1, 2], max_tokens=3), _request("b", [3, 4], max_tokens=3)]
        for request in requests:
            scheduler.add_sequence(request)
        Pipeline(scheduler, greedy_worker(3, 2, max_discarded=steps_in_flight - 1)).drain()
        assert scheduler.num_preemptions >= 1
        outputs[steps_in_flight] = [r.all_token_ids for r in requests]
    assert outputs[2] == outputs[1]


# ---- random workloads: async = sync -------------------------------------------------------

_ops = st.lists(
    st.one_of(
        ADD_OP, ADD_OP, ADD_OP,
        st.tuples(st.just("plan")), st.tuples(st.just("plan")),
        st.tuples(st.just("complete")), st.tuples(st.just("complete")),
        st.tuples(st.just("abort"), st.integers(0, 99)),
        st.tuples(st.just("finish"), st.integers(0, 99)),
        st.tuples(st.just("crash")),
    ),
    min_size=10,
    max_size=50,
)


def _run_workload(ops, *, steps_in_flight: int, num_blocks: int, block_size: int, max_num_seqs: int,
                  budget: int, threshold: int | None, policy: str, prefix_caching: bool, window: int | None,
                  seed: int) -> tuple[dict[str, tuple], Pipeline]:
    """Runs ``ops`` (an op that needs a step out waits for one: the same requests see the same
    aborts in both modes); returns every accepted request's (tokens, status)."""
    scheduler = make_scheduler(num_blocks, block_size, prefix_caching=prefix_caching, max_num_seqs=max_num_seqs,
                               budget=budget, threshold=threshold, policy=policy, sliding_window=window,
                               max_steps_in_flight=steps_in_flight)
    pipeline = Pipeline(scheduler, greedy_worker(num_blocks, block_size, window=window,
                                                 max_discarded=steps_in_flight - 1))
    rng = random.Random(seed)
    bases = [[rng.randrange(1, 4) for _ in range(8)] for _ in range(3)]
    accepted: dict[str, Sequence] = {}
    for op in ops:
        live = sorted(scheduler.sequences)
        if op[0] == "add":
            _, base, length, max_tokens, n, priority, ignore_eos, min_tokens = op
            params = SamplingParams(n=n, max_tokens=max_tokens, ignore_eos=ignore_eos,
                                    min_tokens=min(min_tokens, max_tokens), stop_token_ids=[5] if n == 2 else None)
            requests = make_sequences(f"r{len(accepted)}", bases[base][:length], params,
                                     arrival_time=float(len(accepted)), max_model_len=16, eos_token_ids=(EOS,),
                                     priority=priority)
            for request in requests:
                try:
                    scheduler.add_sequence(request)
                except InvalidRequestError:
                    continue
                accepted[request.seq_id] = request
        elif op[0] == "plan":
            pipeline.plan()
        elif op[0] == "complete" and pipeline.out:
            pipeline.complete()
        elif op[0] == "crash":
            pipeline.crash()
        elif op[0] in ("abort", "finish") and live:
            target = live[op[1] % len(live)]
            if op[0] == "abort":
                scheduler.abort([target])
            else:
                scheduler.finish([target], stop_reason="stop string")
            check_invariants(scheduler)
    pipeline.drain()
    return {seq_id: (tuple(r.all_token_ids), r.status) for seq_id, r in accepted.items()}, pipeline


# The engine's shape: a cache of 8 tokens' blocks and up to 3 more, small budgets and batches.
_SHAPES = dict(extra_blocks=st.integers(0, 3), block_size=st.integers(1, 4), max_num_seqs=st.integers(1, 6),
               budget=st.integers(1, 16), threshold=st.one_of(st.none(), st.integers(1, 6)),
               prefix_caching=st.booleans(), seed=st.integers(0, 2**16))


def _options(extra_blocks: int, block_size: int, **shape) -> dict:
    return dict(num_blocks=-(-8 // block_size) + extra_blocks, block_size=block_size, **shape)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=_ops, policy=st.sampled_from(["fcfs", "priority"]), window=st.one_of(st.none(), st.integers(1, 6)),
       **_SHAPES)
def test_random_workloads_planned_ahead_keep_invariants_and_finish(ops, **shape):
    options = _options(**shape)
    outputs, pipeline = _run_workload(ops, steps_in_flight=2, **options)
    event(f"plans made ahead: {min(pipeline.plans_ahead, 3)}")
    event(f"preemptions: {min(pipeline.scheduler.num_preemptions, 3)}")
    for tokens, status in outputs.values():
        assert status.is_finished
        if status == SequenceStatus.FINISHED_LENGTH_CAPPED:
            assert len(tokens) <= 16


def test_a_recompute_that_needs_the_blocks_its_window_frees_waits_for_its_step_instead_of_preempting_itself():
    """Found by the property above: after a crash, a sequence of 9 tokens with a 1-token window
    in 8 one-token blocks recomputes in chunks of 5. Its second chunk, planned while the first
    was out, found no blocks and preempted the sequence itself, throwing the first away; started
    over, it did the same every step and never finished. The first chunk's result frees the
    blocks the window left behind, so the second chunk now waits for it."""
    ops = [("add", 0, 8, 2, 1, 0, True, 0), ("add", 0, 2, 1, 1, 0, True, 0), ("add", 0, 2, 1, 1, 0, True, 0),
           ("plan",), ("plan",), ("plan",), ("plan",), ("complete",), ("complete",), ("crash",)]
    options = _options(extra_blocks=0, block_size=1, max_num_seqs=1, budget=5, threshold=None,
                       prefix_caching=False, seed=0)
    outputs, pipeline = _run_workload(ops, steps_in_flight=2, policy="fcfs", window=1, **options)
    assert len(outputs) == 3
    assert {seq_id: (len(tokens), status) for seq_id, (tokens, status) in outputs.items()} == {
        "r0": (8 + 2, SequenceStatus.FINISHED_LENGTH_CAPPED), "r1": (2 + 1, SequenceStatus.FINISHED_LENGTH_CAPPED),
        "r2": (2 + 1, SequenceStatus.FINISHED_LENGTH_CAPPED)}
    assert pipeline.scheduler.num_preemptions == 0  # the crash requeued it; nothing preempted it since


_plain_ops = st.lists(st.one_of(ADD_OP, ADD_OP, st.tuples(st.just("plan")), st.tuples(st.just("complete"))),
                      min_size=5, max_size=40)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=_plain_ops, **_SHAPES)
def test_async_scheduling_gives_the_tokens_of_sync_scheduling(ops, **shape):
    """Greedy outputs (tokens and finish) do not depend on planning ahead: chunked prefill,
    EOS, stop ids, n > 1 and preemption under a small cache included."""
    options = _options(policy="fcfs", window=None, **shape)
    # Both runs see requests arrive at the same points of the token stream: sync runs every
    # "plan" then "complete" as one step, async keeps a step out between them.
    sync, _ = _run_workload(ops, steps_in_flight=1, **options)
    planned_ahead, pipeline = _run_workload(ops, steps_in_flight=2, **options)
    event(f"plans made ahead: {min(pipeline.plans_ahead, 3)}")
    assert {k: v[0] for k, v in planned_ahead.items()} == {k: v[0] for k, v in sync.items()}
    assert {k: v[1] for k, v in planned_ahead.items()} == {k: v[1] for k, v in sync.items()}
