"""Unit tests: the scheduler with speculative decoding (``Scheduler(speculation=...)``)
against a simulated worker that proposes and verifies.

The simulated target model samples a fixed token for each (sequence, position), so every
output is known in advance: whatever was proposed, accepted, preempted or recomputed, each
sequence must end with exactly those tokens. The worker checks, as ``test_core_scheduler``'s
does, that every chunk starts where the KV of its sequence is valid and that the positions
before it hold the sequence's own tokens: rejected proposals leave stale KV behind, which only
the scheduler's accounting keeps anyone from reading.
"""

from __future__ import annotations

import hashlib
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.test_core_scheduler import FakeWorker, _WorkerSeq, check_invariants, make_request
from triode.engine.core.kv_blocks import BlockManager
from triode.engine.core.scheduler import Scheduler
from triode.engine.spec_decode.policy import SpeculationPolicy
from triode.engine.worker_messages import (
    AcceptedDrafts,
    Proposal,
    SampledTokens,
    StepPlan,
    StepResult,
)

VOCAB = 50
EOS = 0


def truth(seq_id: str, position: int) -> int:
    """The target model's token at ``position`` of a sequence (never EOS)."""
    digest = hashlib.blake2b(f"{seq_id}/{position}".encode(), digest_size=4).digest()
    return 1 + int.from_bytes(digest, "little") % (VOCAB - 1)


class SpeculatingWorker(FakeWorker):
    """Samples ``truth``; proposes the truth, each token wrong with ``error_rate``."""

    def __init__(self, num_blocks: int, block_size: int, *, error_rate: float, seed: int = 0):
        super().__init__(num_blocks, block_size, seed=seed)
        self.error_rate = error_rate
        self.verified = 0

    def run(self, plan: StepPlan) -> StepResult:
        bs = self.block_size
        for seq_id in plan.finished_seq_ids:
            self.seqs.pop(seq_id, None)
        for new in plan.new_sequences:
            self.seqs[new.seq_id] = _WorkerSeq(list(new.prompt_token_ids + new.output_token_ids))
        sampled, accepted, proposals = [], [], []
        for chunk in plan.chunks:
            seq = self.seqs[chunk.seq_id]
            seq.table.extend(chunk.new_block_ids)
            start, count = chunk.start_position, len(chunk.token_ids)
            assert not chunk.sampled_input
            if seq.next_position is not None:
                assert start == seq.next_position, "chunks continue where the valid KV ends"
            for p in range(start):
                assert self.kv[seq.table[p // bs]][p % bs] == (seq.tokens[p], p), (chunk, p)
            fed = count - chunk.num_draft_tokens
            assert list(chunk.token_ids[:fed]) == seq.tokens[start:start + fed]
            assert start + count <= len(seq.table) * bs, "not enough blocks for the proposals"
            for offset, token in enumerate(chunk.token_ids):
                p = start + offset
                self.kv[seq.table[p // bs]][p % bs] = (token, p)
            seq.next_position = start + fed
            if not chunk.sample:
                continue
            drafts = chunk.token_ids[fed:]
            if drafts:
                self.verified += 1
                assert fed == 1 and start + 1 == len(seq.tokens), "proposals follow the last token"
            kept = []
            for draft in drafts:
                if draft != truth(chunk.seq_id, len(seq.tokens) + len(kept)):
                    break
                kept.append(draft)
            emitted = [*kept, truth(chunk.seq_id, len(seq.tokens) + len(kept))]
            seq.tokens.extend(emitted)
            seq.next_position += len(kept)
            sampled.append((chunk.seq_id, emitted[-1]))
            if kept:
                accepted.append(AcceptedDrafts(chunk.seq_id, tuple(kept), ()))
            if chunk.propose:
                future = [truth(chunk.seq_id, len(seq.tokens) + i) for i in range(chunk.propose)]
                wrong = [t if self.rng.random() >= self.error_rate else t % (VOCAB - 1) + 1 for t in future]
                proposals.append(Proposal(chunk.seq_id, tuple(wrong)))
        return StepResult(step_id=plan.step_id, sampled=SampledTokens(tuple(s for s, _ in sampled), tuple(t for _, t in sampled)), accepted=tuple(accepted),
                          proposals=tuple(proposals))


def make_speculating_scheduler(num_blocks: int, block_size: int, *, budget: int = 64, max_num_seqs: int = 8,
                               num_speculative_tokens: int = 4, disable_by_batch_size: int = 8,
                               max_steps_in_flight: int = 1, row_cost: float = 0.1) -> Scheduler:
    return Scheduler(
        BlockManager(num_blocks, block_size, True), max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
        max_steps_in_flight=max_steps_in_flight,
        speculation=SpeculationPolicy(num_speculative_tokens=num_speculative_tokens,
                                      disable_by_batch_size=disable_by_batch_size, row_cost=row_cost),
    )


def expected_output(request) -> list[int]:
    prompt = len(request.prompt_token_ids)
    return [truth(request.seq_id, p) for p in range(prompt, request.max_num_tokens)]


def run(scheduler: Scheduler, worker: SpeculatingWorker, requests, *, crash_at: tuple[int, ...] = ()
        ) -> dict[str, list[int]]:
    """Every request to the end; the worker restarts at the steps ``crash_at``."""
    outputs: dict[str, list[int]] = {r.seq_id: [] for r in requests}
    for request in requests:
        scheduler.add_sequence(request)
    steps = 0
    while scheduler.has_unfinished_requests():
        steps += 1
        assert steps < 2000, "requests did not finish"
        plan = scheduler.schedule()
        check_invariants(scheduler)
        assert sum(c.num_tokens for c in plan.chunks) <= scheduler.max_num_batched_tokens
        assert plan.chunks, "unfinished requests but nothing scheduled"
        if steps in crash_at:
            worker.restart()
            scheduler.requeue_all_running()
            continue
        for update in scheduler.update_from_output(worker.run(plan)):
            outputs[update.seq_id].extend(update.new_token_ids)
        check_invariants(scheduler)
    assert scheduler.statistics().kv_blocks_free == scheduler.statistics().kv_blocks_total
    return outputs


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    prompts=st.lists(st.integers(1, 12), min_size=1, max_size=6),
    max_tokens=st.integers(1, 24),
    num_blocks=st.integers(8, 40),
    block_size=st.integers(1, 4),
    budget=st.integers(2, 24),
    k=st.integers(1, 6),
    error_rate=st.sampled_from([0.0, 0.2, 0.6, 1.0]),
    crash_at=st.sampled_from([(), (), (3, 11)]),
    seed=st.integers(0, 2**16),
)
def test_outputs_are_the_targets_whatever_is_proposed_accepted_or_recomputed(
        prompts, max_tokens, num_blocks, block_size, budget, k, error_rate, crash_at, seed):
    rng = random.Random(seed)
    requests = [make_request(f"r{i}", [rng.randrange(1, VOCAB) for _ in range(length)], max_tokens=max_tokens,
                             max_model_len=64) for i, length in enumerate(prompts)]
    scheduler = make_speculating_scheduler(max(num_blocks, 40 // block_size + 2), block_size, budget=budget,
                                           num_speculative_tokens=k)
    worker = SpeculatingWorker(scheduler.block_manager.num_blocks, block_size, error_rate=error_rate, seed=seed)
    outputs = run(scheduler, worker, requests, crash_at=crash_at)
    assert len(outputs) == len(requests)
    for request in requests:
        assert outputs[request.seq_id] == expected_output(request)


def test_proposals_are_verified_and_counted():
    scheduler = make_speculating_scheduler(64, 4, num_speculative_tokens=4)
    worker = SpeculatingWorker(64, 4, error_rate=0.0)
    request = make_request("a", [5, 6, 7], max_tokens=21, max_model_len=64)
    outputs = run(scheduler, worker, [request])
    assert outputs["a"] == expected_output(request)
    stats = scheduler.statistics().spec_decode
    assert stats is not None
    # step 1 (prefill) proposes 4; then every step verifies 4 and emits 5: 1 + 5 * 4 = 21
    assert worker.verified == stats.num_drafts == 4
    assert stats.num_draft_tokens == stats.num_accepted_tokens == 16
    assert stats.accepted_per_position == (4, 4, 4, 4)
    assert stats.mean_acceptance_length == 5.0


def test_proposals_never_run_past_max_tokens_or_the_budget():
    scheduler = make_speculating_scheduler(64, 4, num_speculative_tokens=6, budget=4)
    worker = SpeculatingWorker(64, 4, error_rate=0.0)
    request = make_request("a", [5, 6, 7], max_tokens=7, max_model_len=64)
    scheduler.add_sequence(request)
    fed = []
    while scheduler.has_unfinished_requests():
        plan = scheduler.schedule()
        fed.append([c.num_draft_tokens for c in plan.chunks])
        scheduler.update_from_output(worker.run(plan))
    # the budget of 4 leaves room for 3 proposals; after 1 + 4 tokens, 2 remain: 1 proposal
    assert fed == [[0], [3], [1]]
    assert request.output_token_ids == expected_output(request)


def test_a_stop_token_among_the_accepted_ends_the_sequence_there():
    scheduler = make_speculating_scheduler(64, 4, num_speculative_tokens=4)
    worker = SpeculatingWorker(64, 4, error_rate=0.0)
    request = make_request("a", [5, 6, 7], max_tokens=30, max_model_len=64, ignore_eos=False,
                           stop_token_ids=[truth("a", 5)])
    outputs = run(scheduler, worker, [request])
    assert outputs["a"] == [truth("a", 3), truth("a", 4), truth("a", 5)]
    assert request.stop_reason == truth("a", 5)


def test_no_step_is_planned_ahead_of_one_that_speculates():
    scheduler = make_speculating_scheduler(64, 4, max_steps_in_flight=2)
    worker = SpeculatingWorker(64, 4, error_rate=0.0)
    scheduler.add_sequence(make_request("a", [5, 6, 7], max_tokens=12, max_model_len=64))
    plan = scheduler.schedule()
    assert plan.chunks[0].propose == 4
    assert not scheduler.can_schedule()
    scheduler.update_from_output(worker.run(plan))
    assert scheduler.can_schedule()


@pytest.mark.parametrize("running, speculates", [(2, True), (3, False)])
def test_no_sequence_speculates_in_a_batch_past_disable_by_batch_size(running, speculates):
    scheduler = make_speculating_scheduler(64, 4, disable_by_batch_size=2)
    for i in range(running):
        scheduler.add_sequence(make_request(f"r{i}", [5, 6, 7], max_tokens=8, max_model_len=64))
    plan = scheduler.schedule()
    assert len(plan.chunks) == running
    assert all(bool(c.propose) == speculates for c in plan.chunks)


def test_a_sequence_whose_proposals_fail_stops_asking_and_probes_later():
    scheduler = make_speculating_scheduler(128, 4, num_speculative_tokens=4, row_cost=0.35)
    worker = SpeculatingWorker(128, 4, error_rate=1.0)
    request = make_request("a", [5, 6, 7], max_tokens=60, max_model_len=128)
    outputs = run(scheduler, worker, [request])
    assert outputs["a"] == expected_output(request)
    stats = scheduler.statistics().spec_decode
    assert stats is not None and stats.num_accepted_tokens == 0
    # a few verifications at first, then probes after pauses of 4, 8, 16 and 32 steps (each
    # followed by one more: a step asks for the next proposals before its own are verified)
    assert 3 <= stats.num_drafts <= 12
    assert stats.num_draft_tokens <= 20
