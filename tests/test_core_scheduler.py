"""Unit tests: the sans-IO scheduler (triode.engine.core.scheduler) against a simulated worker.

The simulated worker keeps what a real rank keeps (each sequence's tokens and block table) and
a KV cache that records which (token, position) each slot holds, so every plan is checked for
what matters to the model: chunks cover each sequence's tokens once and in order, positions
before a chunk hold exactly that sequence's tokens (prefix hits included), and a step only
writes blocks that no other live sequence uses.
"""

from __future__ import annotations

import pickle
import random

import attrs
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from triode.engine.core.kv_blocks import BlockManager
from triode.engine.core.scheduler import Scheduler
from triode.engine.core.scheduler_output import SequenceUpdate
from triode.engine.core.sequence import Sequence, SequenceStatus, make_sequences
from triode.engine.errors import InvalidRequestError
from triode.engine.sampling_params import SamplingParams
from triode.engine.worker_messages import (
    SampledTokens,
    ScheduledChunk,
    StepPlan,
    StepResult,
    TokenLogprobs,
)

EOS = 0


@attrs.define
class _WorkerSeq:
    tokens: list[int]
    table: list[int] = attrs.field(factory=list)
    next_position: int | None = None  # where the next chunk must start


class FakeWorker:
    """Checks every plan against the KV it wrote. With a sliding ``window`` (every layer's), a
    chunk reads only the positions its queries see, and a sequence owns only the blocks from
    its first visible position on: those before may have been handed to another."""

    def __init__(self, num_blocks: int, block_size: int, seed: int = 0, vocab: int = 6,
                 window: int | None = None, max_discarded: int = 0):
        """``max_discarded``: how many sampled tokens of a sequence the engine may drop when
        it recomputes it (with async scheduling, the one a step planned ahead sampled)."""
        self.max_discarded = max_discarded
        self.block_size = block_size
        self.window = window
        self.kv: list[list[tuple[int, int] | None]] = [[None] * block_size for _ in range(num_blocks)]
        self.seqs: dict[str, _WorkerSeq] = {}
        self.rng = random.Random(seed)
        self.vocab = vocab
        self.forced: dict[str, list[int]] = {}  # seq id -> tokens to sample next
        self.history: dict[str, list[int]] = {}  # the test's record; survives restarts

    def restart(self) -> None:
        """A fresh process: no sequences, and KV memory holding nothing meaningful."""
        self.seqs.clear()
        self.kv = [[None] * self.block_size for _ in self.kv]

    def run(self, plan: StepPlan) -> StepResult:
        bs = self.block_size
        for seq_id in plan.finished_seq_ids:
            self.seqs.pop(seq_id, None)
        for new in plan.new_sequences:
            tokens = list(new.prompt_token_ids + new.output_token_ids)
            if new.seq_id in self.history:  # a recompute carries everything sampled so far
                history = self.history[new.seq_id]
                assert tokens == history[: len(tokens)]
                assert len(history) - len(tokens) <= self.max_discarded
            self.history[new.seq_id] = list(tokens)
            self.seqs[new.seq_id] = _WorkerSeq(tokens)
        assert len({c.seq_id for c in plan.chunks}) == len(plan.chunks)
        # A chunk planned ahead (async scheduling) is fed the token this worker sampled last,
        # as the real worker does: it must have sampled one there.
        chunk_tokens = {
            c.seq_id: (*c.token_ids, self.seqs[c.seq_id].tokens[c.start_position + len(c.token_ids)])
            if c.sampled_input else c.token_ids for c in plan.chunks}
        for chunk in plan.chunks:
            self.seqs[chunk.seq_id].table.extend(chunk.new_block_ids)
        owners: dict[int, set[str]] = {}
        for seq_id, seq in self.seqs.items():
            live = seq.table[self._first_visible(seq.next_position or 0) // bs:]
            assert len(set(live)) == len(live), f"{seq_id} repeats a block"
            for block in live:
                owners.setdefault(block, set()).add(seq_id)
        # Reads first: all computed positions must hold this sequence's own tokens.
        for chunk in plan.chunks:
            seq = self.seqs[chunk.seq_id]
            start, n = chunk.start_position, len(chunk_tokens[chunk.seq_id])
            assert n >= 1
            if seq.next_position is None:
                assert start % bs == 0, "a prefix hit covers whole blocks"
            else:
                assert start == seq.next_position, "chunks must continue where the last ended"
            seq.next_position = start + n
            assert list(chunk_tokens[chunk.seq_id]) == seq.tokens[start : start + n]
            assert start + n <= len(seq.table) * bs, "not enough blocks for the chunk"
            assert chunk.sample == (start + n == len(seq.tokens))
            for p in range(self._first_visible(start), start):
                assert self.kv[seq.table[p // bs]][p % bs] == (seq.tokens[p], p), (chunk, p)
        # Then writes, only into blocks this sequence alone holds.
        sampled = []
        for chunk in plan.chunks:
            seq = self.seqs[chunk.seq_id]
            for p in range(chunk.start_position, chunk.start_position + chunk.num_tokens):
                block = seq.table[p // bs]
                assert owners[block] == {chunk.seq_id}, f"write into shared block {block}"
                self.kv[block][p % bs] = (seq.tokens[p], p)
            if chunk.sample:
                forced = self.forced.get(chunk.seq_id)
                token = forced.pop(0) if forced else self.rng.randrange(self.vocab)
                seq.tokens.append(token)
                self.history[chunk.seq_id].append(token)
                sampled.append((chunk.seq_id, token))
        return StepResult(step_id=plan.step_id, sampled=SampledTokens(tuple(s for s, _ in sampled),
                                                                      tuple(t for _, t in sampled)))

    def _first_visible(self, position: int) -> int:
        """The first key a query at ``position`` sees."""
        return 0 if self.window is None else max(0, position - self.window + 1)


def check_invariants(scheduler: Scheduler) -> None:
    bm = scheduler.block_manager
    refs = [0] * bm.num_blocks
    for request in scheduler.sequences.values():
        assert len(set(request.held_block_ids)) == len(request.held_block_ids)
        if request.status != SequenceStatus.RUNNING:
            assert request.block_ids == []
        for block in request.held_block_ids:
            refs[block] += 1
    assert refs == bm.ref_counts, "reference counts do not match the block tables"
    assert set(bm.free_queue) == {b for b in range(bm.num_blocks) if refs[b] == 0}
    for block_hash, block in bm.cached.items():
        assert bm.block_hash[block] == block_hash
    assert len(scheduler.running) <= scheduler.max_num_seqs
    assert len(scheduler.running) + len(scheduler.waiting) == len(scheduler.sequences)
    keys = [scheduler._key(r) for r in scheduler.waiting]
    assert keys == sorted(keys)


def _ends_in_flight(request: Sequence) -> bool:
    """A step in flight (async scheduling) samples the request's last allowed token."""
    return bool(request.num_in_flight_samples) and (
        request.num_tokens + request.num_in_flight_samples >= request.max_num_tokens)


def _waits_for_its_step(scheduler: Scheduler, request: Sequence) -> bool:
    """Short of blocks, the request would preempt itself (it is last in line), but a step in
    flight has its tokens: it waits for that step, which may free blocks behind a window."""
    return bool(request.num_in_flight_tokens) and request is max(scheduler.running, key=scheduler._key)


def check_plan(scheduler: Scheduler, plan: StepPlan) -> None:
    num_tokens = sum(c.num_tokens for c in plan.chunks)
    assert num_tokens <= scheduler.max_num_batched_tokens
    scheduled = {c.seq_id for c in plan.chunks}
    if num_tokens < scheduler.max_num_batched_tokens:  # budget left: nobody running was skipped
        assert {r.seq_id for r in scheduler.running if r.seq_id in scheduled
                or not (_ends_in_flight(r) or _waits_for_its_step(scheduler, r))} == scheduled
    assert len(plan.chunks) <= scheduler.max_num_seqs
    if scheduler.long_prefill_token_threshold:
        assert all(c.num_tokens <= scheduler.long_prefill_token_threshold for c in plan.chunks)
    # Only a sequence forgotten and started again (a recompute) is in both.
    assert {c.seq_id for c in plan.chunks} & set(plan.finished_seq_ids) <= {n.seq_id for n in plan.new_sequences}
    assert {n.seq_id for n in plan.new_sequences} <= {c.seq_id for c in plan.chunks}


def make_scheduler(
    num_blocks: int = 16,
    block_size: int = 4,
    *,
    prefix_caching: bool = True,
    max_num_seqs: int = 8,
    budget: int = 64,
    threshold: int | None = None,
    policy: str = "fcfs",
    sliding_window: int | None = None,
    max_steps_in_flight: int = 1,
) -> Scheduler:
    return Scheduler(
        BlockManager(num_blocks, block_size, prefix_caching, sliding_window=sliding_window),
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        long_prefill_token_threshold=threshold,
        scheduling_policy=policy,
        max_steps_in_flight=max_steps_in_flight,
    )


def make_request(
    request_id: str,
    prompt: list[int],
    *,
    arrival: float = 0.0,
    priority: int = 0,
    max_model_len: int = 64,
    **params,
) -> Sequence:
    params.setdefault("max_tokens", 4)
    params.setdefault("ignore_eos", True)
    return Sequence(
        request_id, prompt, SamplingParams(**params), arrival_time=arrival,
        max_model_len=max_model_len, eos_token_ids=(EOS,), priority=priority,
    )


def step(scheduler: Scheduler, worker: FakeWorker) -> tuple[StepPlan, list]:
    plan = scheduler.schedule()
    check_plan(scheduler, plan)
    check_invariants(scheduler)
    if not plan.chunks:
        return plan, []
    updates = scheduler.update_from_output(worker.run(plan))
    check_invariants(scheduler)
    return plan, updates


def drain(scheduler: Scheduler, worker: FakeWorker, max_steps: int = 3000) -> None:
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            break
        plan, _ = step(scheduler, worker)
        assert plan.chunks, "unfinished requests but nothing scheduled: deadlock"
    assert not scheduler.has_unfinished_requests(), "requests did not finish"
    stats = scheduler.statistics()
    assert stats.kv_blocks_free == stats.kv_blocks_total
    assert stats.num_running == stats.num_waiting == 0


# ---- property test over random workloads ---------------------------------------------------

ADD_OP = st.tuples(
    st.just("add"),
    st.integers(0, 2),  # which shared prompt base
    st.integers(2, 8),  # prompt length
    st.integers(1, 10),  # max_tokens
    st.sampled_from([1, 1, 2, 3]),  # n
    st.integers(0, 2),  # priority
    st.sampled_from([True, True, False]),  # ignore_eos
    st.integers(0, 3),  # min_tokens (capped by max_tokens)
)
_ops = st.lists(
    st.one_of(
        ADD_OP,
        ADD_OP,
        ADD_OP,
        st.tuples(st.just("step")),
        st.tuples(st.just("step")),
        st.tuples(st.just("step"), st.just("abort_in_flight"), st.integers(0, 99)),
        st.tuples(st.just("step"), st.just("crash")),
        st.tuples(st.just("abort"), st.integers(0, 99), st.booleans()),
        st.tuples(st.just("finish"), st.integers(0, 99)),
    ),
    min_size=10,
    max_size=50,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=_ops,
    extra_blocks=st.integers(0, 3),
    block_size=st.integers(1, 4),
    max_num_seqs=st.integers(1, 6),
    budget=st.integers(1, 16),
    threshold=st.one_of(st.none(), st.integers(1, 6)),
    policy=st.sampled_from(["fcfs", "priority"]),
    prefix_caching=st.booleans(),
    seed=st.integers(0, 2**16),
    window=st.one_of(st.none(), st.integers(1, 6)),
)
def test_random_workloads_keep_invariants_and_finish(
    ops, extra_blocks, block_size, max_num_seqs, budget, threshold, policy, prefix_caching, seed, window
):
    num_blocks = -(-8 // block_size) + extra_blocks  # some requests will not fit
    scheduler = make_scheduler(
        num_blocks, block_size, prefix_caching=prefix_caching, max_num_seqs=max_num_seqs,
        budget=budget, threshold=threshold, policy=policy, sliding_window=window,
    )
    worker = FakeWorker(num_blocks, block_size, seed, window=window)
    rng = random.Random(seed)
    bases = [[rng.randrange(1, 4) for _ in range(8)] for _ in range(3)]
    accepted: list[Sequence] = []
    clock = 0.0
    for op in ops:
        clock += 1.0
        live = sorted(scheduler.sequences)
        if op[0] == "add":
            _, base, length, max_tokens, n, priority, ignore_eos, min_tokens = op
            prompt = bases[base][:length]
            if rng.random() < 0.5:
                prompt = [*prompt[: rng.randrange(1, length + 1)], rng.randrange(1, 6)]
            params = SamplingParams(
                n=n, max_tokens=max_tokens, ignore_eos=ignore_eos,
                min_tokens=min(min_tokens, max_tokens), stop_token_ids=[5] if n == 2 else None,
            )
            requests = make_sequences(
                f"r{len(accepted)}", prompt, params, arrival_time=rng.choice([clock, clock - 5]),
                max_model_len=16, eos_token_ids=(EOS,), priority=priority,
            )
            for request in requests:
                needed = -(-(request.max_num_tokens - 1) // block_size)
                if window is not None:
                    needed = min(needed, -(-(window - 1 + budget) // block_size) + 1)
                if needed > num_blocks:
                    with pytest.raises(InvalidRequestError):
                        scheduler.add_sequence(request)
                else:
                    scheduler.add_sequence(request)
                    accepted.append(request)
        elif op[0] == "step" and len(op) == 1:
            step(scheduler, worker)
        elif op[0] == "step":
            plan = scheduler.schedule()
            check_plan(scheduler, plan)
            if plan.chunks:
                if op[1] == "crash":
                    free_before = scheduler.block_manager.num_free_blocks
                    num_running = len(scheduler.running)
                    requeued = scheduler.requeue_all_running()
                    assert len(requeued) == num_running
                    assert all(r.status == SequenceStatus.PREEMPTED for r in requeued)
                    assert scheduler.block_manager.num_free_blocks >= free_before
                    assert not scheduler.block_manager.cached
                    worker.restart()
                else:
                    result = worker.run(plan)
                    victims = [c.seq_id for c in plan.chunks]
                    scheduler.abort([victims[op[2] % len(victims)]])
                    scheduler.update_from_output(result)
            check_invariants(scheduler)
        elif op[0] == "abort" and live:
            target = live[op[1] % len(live)]
            if op[2]:
                target = scheduler.sequences[target].request_id  # the user's id: every sibling
            free_before = scheduler.block_manager.num_free_blocks
            held = sum(len(r.held_block_ids) for r in scheduler.abort([target]))
            assert scheduler.block_manager.num_free_blocks >= free_before + (held > 0)
            check_invariants(scheduler)
        elif op[0] == "finish" and live:
            scheduler.finish([live[op[1] % len(live)]], stop_reason="stop string")
            check_invariants(scheduler)
    drain(scheduler, worker)
    stats = scheduler.statistics()
    event(f"preemptions: {min(stats.num_preemptions, 3)}")
    event(f"prefix hits: {stats.prefix_cache_hits > 0}")
    event(f"accepted: {min(len(accepted), 8)}")
    for request in accepted:
        assert request.is_finished
        assert request.num_output_tokens <= request.max_num_tokens - request.num_prompt_tokens
        if request.status == SequenceStatus.FINISHED_LENGTH_CAPPED:
            assert request.num_tokens == request.max_num_tokens
    assert all(refs == 0 for refs in scheduler.block_manager.ref_counts)


_request_specs = st.lists(
    st.tuples(
        st.integers(0, 1),  # shared prompt base
        st.integers(1, 10),  # prompt length
        st.integers(1, 10),  # max_tokens
        st.sampled_from([1, 1, 2, 3]),  # n
        st.integers(0, 2),  # priority
        st.integers(0, 5),  # steps to wait before adding it
    ),
    min_size=2,
    max_size=10,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    specs=_request_specs,
    block_size=st.integers(1, 4),
    num_blocks=st.integers(4, 12),
    max_num_seqs=st.integers(2, 6),
    budget=st.integers(2, 24),
    threshold=st.one_of(st.none(), st.integers(1, 6)),
    policy=st.sampled_from(["fcfs", "priority"]),
    prefix_caching=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_memory_pressure_preempts_and_still_finishes_everything(
    specs, block_size, num_blocks, max_num_seqs, budget, threshold, policy, prefix_caching, seed
):
    """Long outputs in a cache too small for all of them: preemption is the norm here."""
    scheduler = make_scheduler(
        num_blocks, block_size, prefix_caching=prefix_caching, max_num_seqs=max_num_seqs,
        budget=budget, threshold=threshold, policy=policy,
    )
    worker = FakeWorker(num_blocks, block_size, seed)
    rng = random.Random(seed)
    bases = [[rng.randrange(1, 3) for _ in range(10)] for _ in range(2)]
    capacity = num_blocks * block_size
    pending = sorted(enumerate(specs), key=lambda item: item[1][-1])
    accepted: list[Sequence] = []
    for clock in range(3000):
        while pending and pending[0][1][-1] <= clock:
            i, (base, length, max_tokens, n, priority, _) = pending.pop(0)
            params = SamplingParams(n=n, max_tokens=max_tokens, ignore_eos=True)
            for request in make_sequences(
                f"r{i}", bases[base][:length], params, arrival_time=float(clock),
                max_model_len=32, priority=priority,
            ):
                if request.max_num_tokens - 1 > capacity:
                    with pytest.raises(InvalidRequestError):
                        scheduler.add_sequence(request)
                else:
                    scheduler.add_sequence(request)
                    accepted.append(request)
        if not pending and not scheduler.has_unfinished_requests():
            break
        step(scheduler, worker)
    drain(scheduler, worker)
    event(f"preemptions: {min(scheduler.num_preemptions, 3)}")
    for request in accepted:
        assert request.status == SequenceStatus.FINISHED_LENGTH_CAPPED
        assert request.num_tokens == request.max_num_tokens
        assert request.all_token_ids == worker.history[request.seq_id]


# ---- chunked prefill --------------------------------------------------------------------------


def test_chunked_prefill_covers_the_prompt_once_in_order():
    scheduler = make_scheduler(num_blocks=8, block_size=4, budget=4)
    worker = FakeWorker(8, 4)
    prompt = list(range(1, 11))
    scheduler.add_sequence(make_request("a", prompt, max_tokens=2))
    plans = [step(scheduler, worker)[0] for _ in range(4)]
    chunks = [p.chunks[0] for p in plans]
    assert [p.new_sequences[0].seq_id for p in plans[:1]] == ["a"]
    assert all(not p.new_sequences for p in plans[1:])
    assert [c.start_position for c in chunks] == [0, 4, 8, 10]
    assert [c.token_ids for c in chunks[:3]] == [(1, 2, 3, 4), (5, 6, 7, 8), (9, 10)]
    assert [c.sample for c in chunks] == [False, False, True, True]
    assert [len(c.new_block_ids) for c in chunks] == [1, 1, 1, 0]
    assert chunks[3].token_ids == (worker.seqs["a"].tokens[10],)  # the decode feeds the sample
    assert not scheduler.has_unfinished_requests()
    assert plans[3].chunks and scheduler.schedule().finished_seq_ids == ("a",)


def test_the_records_a_step_builds_hold_every_field_across_the_wire():
    """Chunks and updates are built with tuple.__new__, which checks no length: a short
    record would read as fine until some field past its end was asked for. (A result's sampled
    tokens are columns, which cross as they are.)"""
    scheduler = make_scheduler(num_blocks=8, block_size=4, budget=16)
    worker = FakeWorker(8, 4)
    for name in "ab":
        scheduler.add_sequence(make_request(name, [1, 2, 3], max_tokens=3))
    plan, updates = step(scheduler, worker)
    plan, updates = step(scheduler, worker)  # decodes, the common step
    received = pickle.loads(pickle.dumps(plan))
    assert len(plan.chunks) == len(received.chunks) == 2 and len(updates) == 2
    assert received == plan
    for chunk in received.chunks:
        assert len(chunk) == len(ScheduledChunk._fields) and chunk.propose == 0
    for update in updates:
        assert len(update) == len(SequenceUpdate._fields) and update.embedding is None
    result = worker.run(scheduler.schedule())
    received_result = pickle.loads(pickle.dumps(result))
    assert len(result.sampled.seq_ids) == 2 and received_result == result


def test_long_prefill_threshold_chunks_a_prompt_and_lets_decodes_through():
    scheduler = make_scheduler(num_blocks=16, block_size=4, budget=64, threshold=3)
    worker = FakeWorker(16, 4)
    scheduler.add_sequence(make_request("short", [1, 2], max_tokens=5))
    step(scheduler, worker)
    scheduler.add_sequence(make_request("long", list(range(1, 9)), arrival=1.0, max_tokens=1))
    sizes = []
    for _ in range(3):
        plan, _ = step(scheduler, worker)
        sizes.append({c.seq_id: len(c.token_ids) for c in plan.chunks})
    assert sizes == [{"short": 1, "long": 3}, {"short": 1, "long": 3}, {"short": 1, "long": 2}]


def test_budget_and_max_num_seqs_bound_admission():
    scheduler = make_scheduler(num_blocks=32, block_size=4, budget=5, max_num_seqs=2)
    worker = FakeWorker(32, 4)
    for i in range(3):
        scheduler.add_sequence(make_request(f"r{i}", [1, 2, 3], arrival=float(i)))
    plan, _ = step(scheduler, worker)
    assert [(c.seq_id, len(c.token_ids)) for c in plan.chunks] == [("r0", 3), ("r1", 2)]
    plan, _ = step(scheduler, worker)
    assert [(c.seq_id, len(c.token_ids)) for c in plan.chunks] == [("r0", 1), ("r1", 1)]
    assert [r.seq_id for r in scheduler.waiting] == ["r2"]


# ---- preemption ---------------------------------------------------------------------------------


def _fill(scheduler: Scheduler, worker: FakeWorker, requests: list[Sequence]) -> None:
    for request in requests:
        scheduler.add_sequence(request)
    step(scheduler, worker)
    assert len(scheduler.running) == len(requests)


@pytest.mark.parametrize(
    ("policy", "priorities", "victim"),
    [
        ("priority", (1, 0, 1), "c"),  # lowest priority, then the latest arrival
        ("priority", (1, 0, 0), "a"),  # lowest priority wins over arrival
        ("fcfs", (0, 1, 0), "c"),  # FCFS ignores priority: the latest arrival
    ],
)
def test_preemption_order(policy, priorities, victim):
    # Three sequences of one full block each and one free block: two decodes need a new block.
    scheduler = make_scheduler(num_blocks=4, block_size=2, policy=policy)
    worker = FakeWorker(4, 2)
    _fill(scheduler, worker, [
        make_request(name, [1, i + 2], arrival=float(i), priority=priority, max_tokens=3)
        for i, (name, priority) in enumerate(zip("abc", priorities, strict=True))
    ])
    plan, _ = step(scheduler, worker)
    assert scheduler.num_preemptions == 1
    assert scheduler.sequences[victim].status == SequenceStatus.PREEMPTED
    assert plan.finished_seq_ids == (victim,)  # the worker drops its state
    assert sorted(c.seq_id for c in plan.chunks) == sorted(set("abc") - {victim})
    assert not plan.new_sequences  # no admission in a step that had to preempt
    drain(scheduler, worker)


def test_fcfs_victim_is_the_latest_arrival_not_the_last_admitted():
    scheduler = make_scheduler(num_blocks=3, block_size=4)
    worker = FakeWorker(3, 4)
    _fill(scheduler, worker, [
        make_request("b", [1, 2], arrival=1.0, max_tokens=6),
        make_request("c", [1, 3], arrival=2.0, max_tokens=6),
    ])
    # "a" arrived first but reached the scheduler last (its prompt took longer to tokenize).
    scheduler.add_sequence(make_request("a", [1, 4], arrival=0.0, max_tokens=6))
    step(scheduler, worker)
    assert [r.seq_id for r in scheduler.running] == ["b", "c", "a"]
    step(scheduler, worker)  # decodes at position 3 fill the first blocks
    plan, _ = step(scheduler, worker)  # b needs a second block, and none is free
    assert plan.finished_seq_ids == ("c",)
    assert [c.seq_id for c in plan.chunks] == ["b", "a"]
    drain(scheduler, worker)


def test_preempting_an_earlier_running_request_skips_no_one():
    scheduler = make_scheduler(num_blocks=4, block_size=2, policy="priority")
    worker = FakeWorker(4, 2)
    _fill(scheduler, worker, [make_request("a", [1, 2], priority=2, max_tokens=5)])
    for name in "bc":
        scheduler.add_sequence(make_request(name, [1, 3], arrival=1.0, max_tokens=5))
    step(scheduler, worker)
    assert [r.seq_id for r in scheduler.running] == ["a", "b", "c"]
    plan, _ = step(scheduler, worker)  # b needs a block: "a", ahead of it, is the victim
    assert plan.finished_seq_ids == ("a",)
    assert [c.seq_id for c in plan.chunks] == ["b", "c"]
    drain(scheduler, worker)


def test_preempted_request_resumes_with_its_output_tokens():
    scheduler = make_scheduler(num_blocks=4, block_size=2, prefix_caching=False)
    worker = FakeWorker(4, 2)
    _fill(scheduler, worker, [
        make_request("a", [1, 2, 3], arrival=0.0, max_tokens=4),
        make_request("b", [4, 5, 6], arrival=1.0, max_tokens=4),
    ])
    output_before = None
    for _ in range(10):
        plan, _ = step(scheduler, worker)
        resumed = [n for n in plan.new_sequences if n.seq_id == "b"]
        if resumed:
            assert resumed[0].output_token_ids == tuple(output_before)
            chunk = next(c for c in plan.chunks if c.seq_id == "b")
            assert chunk.start_position == 0 and chunk.new_block_ids  # a fresh block table
            break
        output_before = scheduler.sequences["b"].output_token_ids
    else:
        pytest.fail("b was never preempted and resumed")
    assert scheduler.num_preemptions == 1
    drain(scheduler, worker)


def test_request_that_cannot_fit_alone_is_rejected_at_add():
    scheduler = make_scheduler(num_blocks=2, block_size=4)
    with pytest.raises(InvalidRequestError) as info:
        scheduler.add_sequence(make_request("big", [1] * 9, max_tokens=1))
    assert info.value.field == "prompt"
    with pytest.raises(InvalidRequestError) as info:
        scheduler.add_sequence(make_request("long", [1] * 4, max_tokens=6))
    assert info.value.field == "max_tokens"
    scheduler.add_sequence(make_request("fits", [1] * 4, max_tokens=5))  # 8 positions with KV
    drain(scheduler, FakeWorker(2, 4))


# ---- aborts and external finishes ------------------------------------------------------------


def test_abort_frees_blocks_before_the_next_plan():
    scheduler = make_scheduler(num_blocks=8, block_size=2)
    worker = FakeWorker(8, 2)
    _fill(scheduler, worker, [
        make_request("a", [1, 2, 3], max_tokens=8),
        make_request("b", [4, 5, 6], arrival=1.0, max_tokens=8),
    ])
    free_before = scheduler.block_manager.num_free_blocks
    (aborted,) = scheduler.abort(["a"])
    assert aborted.status == SequenceStatus.FINISHED_ABORTED and aborted.finish_reason == "abort"
    assert scheduler.block_manager.num_free_blocks == free_before + 2
    plan, _ = step(scheduler, worker)
    assert plan.finished_seq_ids == ("a",)
    assert [c.seq_id for c in plan.chunks] == ["b"]
    assert scheduler.abort(["a", "unknown"]) == []


def test_abort_while_a_step_is_in_flight_ignores_its_token():
    scheduler = make_scheduler()
    worker = FakeWorker(16, 4)
    scheduler.add_sequence(make_request("a", [1, 2]))
    result = worker.run(scheduler.schedule())
    scheduler.abort(["a"])
    assert scheduler.update_from_output(result) == []
    assert scheduler.schedule().finished_seq_ids == ("a",)
    assert scheduler.statistics().kv_blocks_free == 16


def test_abort_of_a_waiting_request_sends_nothing_to_the_worker():
    scheduler = make_scheduler()
    scheduler.add_sequence(make_request("a", [1, 2]))
    scheduler.abort(["a"])
    assert scheduler.schedule() == StepPlan(step_id=1)


def test_finish_records_the_stop_string():
    scheduler = make_scheduler()
    worker = FakeWorker(16, 4)
    scheduler.add_sequence(make_request("a", [1, 2], max_tokens=10))
    step(scheduler, worker)
    (request,) = scheduler.finish(["a"], stop_reason="###")
    assert (request.finish_reason, request.stop_reason) == ("stop", "###")
    assert scheduler.schedule().finished_seq_ids == ("a",)


def test_requeue_all_running_recomputes_without_counting_preemptions():
    scheduler = make_scheduler(num_blocks=8, block_size=2)
    worker = FakeWorker(8, 2)
    _fill(scheduler, worker, [make_request("a", [1, 2, 3], max_tokens=5)])
    step(scheduler, worker)
    tokens = list(scheduler.sequences["a"].all_token_ids)
    plan = scheduler.schedule()
    scheduler.abort([])  # nothing
    requeued = scheduler.requeue_all_running()  # the step is lost with the worker
    assert [r.seq_id for r in requeued] == ["a"]
    assert scheduler.statistics().kv_blocks_free == 8
    assert scheduler.num_preemptions == 0
    worker.restart()
    plan = scheduler.schedule()
    assert plan.finished_seq_ids == ()
    (new,) = plan.new_sequences
    assert list(new.prompt_token_ids + new.output_token_ids) == tokens
    assert plan.chunks[0].start_position == 0  # the prefix cache was emptied too
    scheduler.update_from_output(worker.run(plan))
    drain(scheduler, worker)


def _steps_under_pressure(restart_at: int | None) -> tuple[int, int]:
    """Model steps and tokens fed for eight long requests in a cache that holds about one
    and a half of them (the preemption-during-crash scenario, scaled down)."""
    rng = random.Random(0)
    scheduler = make_scheduler(num_blocks=22, block_size=4, max_num_seqs=16, budget=64)
    worker = FakeWorker(22, 4)
    for i in range(8):
        prompt = [rng.randrange(1, 6) for _ in range(rng.randint(25, 45))]
        scheduler.add_sequence(make_request(f"r{i}", prompt, arrival=i, max_tokens=6, max_model_len=64))
    steps = tokens = 0
    while scheduler.has_unfinished_requests():
        plan = scheduler.schedule()
        if not plan.chunks:
            continue
        steps += 1
        tokens += sum(len(c.token_ids) for c in plan.chunks)
        assert steps < 1000, "no progress under KV pressure"
        if steps == restart_at:
            scheduler.requeue_all_running()  # the worker died with this step
            worker.restart()
            continue
        scheduler.update_from_output(worker.run(plan))
        check_invariants(scheduler)
    assert scheduler.num_preemptions > 0
    return steps, tokens


@pytest.mark.parametrize("restart_at", [2, 5, 12, 25])
def test_a_restart_under_kv_pressure_costs_only_the_recompute(restart_at):
    # A worker restart while a small cache forces preemption must not send the scheduler
    # into thrashing: it costs the lost step and recomputing what was running, nothing more.
    steps, tokens = _steps_under_pressure(None)
    steps_restarted, tokens_restarted = _steps_under_pressure(restart_at)
    running_tokens = 22 * 4  # at most the whole cache was running and must be recomputed
    assert steps_restarted <= steps + 1 + running_tokens // 64 + 1
    assert tokens_restarted <= tokens + 64 + running_tokens


def test_result_for_a_different_step_is_rejected():
    scheduler = make_scheduler()
    scheduler.add_sequence(make_request("a", [1, 2]))
    plan = scheduler.schedule()
    with pytest.raises(RuntimeError):
        scheduler.schedule()
    with pytest.raises(RuntimeError):
        scheduler.update_from_output(StepResult(step_id=plan.step_id + 1))


# ---- stop checks ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("params", "sampled", "expected"),
    [
        ({"ignore_eos": False}, [7, EOS], (2, "stop", None)),
        ({"ignore_eos": True}, [7, EOS, 7, 7], (4, "length", None)),
        ({"stop_token_ids": [9]}, [7, 9], (2, "stop", 9)),
        ({"ignore_eos": False, "min_tokens": 3}, [EOS, 9, EOS, EOS], (3, "stop", None)),
        ({"stop_token_ids": [9], "min_tokens": 2}, [9, 9], (2, "stop", 9)),
        ({"ignore_eos": False, "max_tokens": 2}, [7, EOS], (2, "stop", None)),
        ({"max_tokens": None}, [7] * 10, (6, "length", None)),  # max_model_len 10, prompt 4
    ],
)
def test_token_id_stop_checks(params, sampled, expected):
    scheduler = make_scheduler()
    worker = FakeWorker(16, 4)
    params.setdefault("max_tokens", 4)
    scheduler.add_sequence(make_request("a", [1, 2, 3, 4], max_model_len=10, **params))
    worker.forced["a"] = list(sampled)
    updates = []
    while scheduler.has_unfinished_requests():
        updates += step(scheduler, worker)[1]
    tokens = [t for u in updates for t in u.new_token_ids]
    last = updates[-1]
    assert (len(tokens), last.finish_reason, last.stop_reason) == expected
    assert all(u.finish_reason is None for u in updates[:-1])


def test_prompt_of_max_model_len_gets_one_token():
    scheduler = make_scheduler()
    scheduler.add_sequence(make_request("a", [1] * 8, max_model_len=8, max_tokens=None))
    drain(scheduler, FakeWorker(16, 4))
    with pytest.raises(InvalidRequestError):
        make_request("b", [1] * 9, max_model_len=8)
    with pytest.raises(InvalidRequestError):
        make_request("c", [])


# ---- prefix caching and n > 1 ---------------------------------------------------------------


def test_parallel_samples_share_the_prompt_blocks():
    scheduler = make_scheduler(num_blocks=16, block_size=4)
    worker = FakeWorker(16, 4)
    prompt = list(range(1, 10))  # two full blocks and one token
    params = SamplingParams(n=3, max_tokens=3, seed=7)
    children = make_sequences("p", prompt, params, arrival_time=0.0, max_model_len=64)
    assert [c.seq_id for c in children] == ["p-0", "p-1", "p-2"]
    assert [c.params.seed for c in children] == [7, 8, 9] and children[1].params.n == 1
    for child in children:
        scheduler.add_sequence(child)
    plan, _ = step(scheduler, worker)
    assert [c.seq_id for c in plan.chunks] == ["p-0"]  # siblings wait for the shared blocks
    plan, _ = step(scheduler, worker)
    assert {c.seq_id: c.start_position for c in plan.chunks} == {"p-0": 9, "p-1": 8, "p-2": 8}
    shared = children[0].block_ids[:2]
    assert all(c.block_ids[:2] == shared for c in children)
    assert [scheduler.block_manager.ref_counts[b] for b in shared] == [3, 3]
    assert children[1].num_cached_tokens == 8
    stats = scheduler.statistics()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (27, 16)
    scheduler.abort(["p"])  # the user's id reaches every sibling
    assert scheduler.statistics().kv_blocks_free == 16


def test_prefix_cache_reuses_a_finished_conversation_and_evicts_lru():
    scheduler = make_scheduler(num_blocks=6, block_size=2)
    worker = FakeWorker(6, 2)
    scheduler.add_sequence(make_request("a", [1, 2, 3, 4, 5], max_tokens=1))
    drain(scheduler, worker)
    scheduler.add_sequence(make_request("b", [1, 2, 3, 4, 9], max_tokens=1))
    plan, _ = step(scheduler, worker)
    assert plan.chunks[0].start_position == 4
    drain(scheduler, worker)
    # A full-cache request evicts: unreferenced tail blocks first, the shared head last.
    scheduler.add_sequence(make_request("c", [7, 7, 7, 7, 7, 7, 7, 7, 7], max_tokens=1))
    drain(scheduler, worker)
    scheduler.add_sequence(make_request("d", [1, 2, 6], max_tokens=1))
    plan, _ = step(scheduler, worker)
    assert plan.chunks[0].start_position == 2  # block [1, 2] survived as the most reused


def test_prefix_caching_disabled_never_hits():
    scheduler = make_scheduler(prefix_caching=False)
    worker = FakeWorker(16, 4)
    for name in "ab":
        scheduler.add_sequence(make_request(name, list(range(1, 10)), max_tokens=1))
        plan, _ = step(scheduler, worker)
        assert plan.chunks[0].start_position == 0
    assert scheduler.statistics().prefix_cache_queries == 0


def test_from_engine_args_and_statistics():
    from triode.engine.config import EngineArgs

    args = EngineArgs(max_num_seqs=3, max_num_batched_tokens=32, block_size=8,
                      enable_prefix_caching=False, scheduling_policy="priority")
    scheduler = Scheduler.from_engine_args(args, num_blocks=10)
    assert scheduler.max_num_seqs == 3 and scheduler.block_manager.block_size == 8
    assert not scheduler.block_manager.enable_prefix_caching
    stats = scheduler.statistics()
    assert (stats.kv_blocks_total, stats.kv_blocks_free, stats.num_preemptions) == (10, 10, 0)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        stats.num_running = 1


def test_prompt_logprobs_are_not_repeated_after_a_recompute():
    scheduler = make_scheduler(budget=2)
    scheduler.add_sequence(make_request("a", [1, 2, 3, 4, 5], prompt_logprobs=0))

    def run_prefill_chunk(expected_start: int) -> list:
        plan = scheduler.schedule()
        (chunk,) = plan.chunks
        assert chunk.start_position == expected_start
        entries = tuple(
            TokenLogprobs(token_id=t, logprob=-1.0, rank=1)
            for t in [1, 2, 3, 4, 5][expected_start + 1 : expected_start + 3]
        )
        return scheduler.update_from_output(
            StepResult(step_id=plan.step_id, prompt_logprobs=(("a", entries),))
        )

    (update,) = run_prefill_chunk(0)
    assert [e.token_id for e in update.prompt_logprobs] == [2, 3]
    scheduler.requeue_all_running()
    assert run_prefill_chunk(0) == []  # recomputed, already reported
    (update,) = run_prefill_chunk(2)
    assert [e.token_id for e in update.prompt_logprobs] == [4, 5]
