"""Unit tests: LoRA adapters in the sans-IO scheduler and block manager. An adapter's sequences
wait until the workers report it read (asked for in a plan, a plan that only waits for the read
when nothing else runs) while others run on; at most ``max_loras`` adapters run at once, and a
sequence waiting for a slot is passed by the base model's sequences only; a worker restart or
an eviction asks for an adapter again; an adapter the workers could not read ends its
sequences with "abort" updates; and KV computed under one adapter is never a prefix hit for
another."""

from __future__ import annotations

from triode.engine.core.kv_blocks import BlockManager
from triode.engine.core.scheduler import Scheduler
from triode.engine.core.sequence import Sequence, SequenceStatus
from triode.engine.lora.request import LoRARequest
from triode.engine.sampling_params import SamplingParams
from triode.engine.worker_messages import SampledTokens, StepPlan, StepResult

A, B = LoRARequest("a", 1, "/adapters/a"), LoRARequest("b", 2, "/adapters/b")
PARAMS = SamplingParams(max_tokens=2, ignore_eos=True)


def _scheduler(max_loras: int = 1) -> Scheduler:
    return Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=64, max_loras=max_loras)


def _add(scheduler: Scheduler, seq_id: str, lora: LoRARequest | None, tokens=(1, 2, 3, 4, 5)) -> Sequence:
    seq = Sequence(seq_id, tokens, PARAMS, arrival_time=float(len(scheduler.sequences)), max_model_len=64,
                   lora=lora)
    scheduler.add_sequence(seq)
    return seq


def _result(plan: StepPlan, **news) -> StepResult:
    seq_ids = tuple(c.seq_id for c in plan.chunks if c.sample)
    return StepResult(step_id=plan.step_id, sampled=SampledTokens(seq_ids, (7,) * len(seq_ids)), **news)


def _scheduled(plan: StepPlan) -> set[str]:
    return {chunk.seq_id for chunk in plan.chunks}


def test_an_adapter_waits_for_its_read_while_the_base_model_runs():
    scheduler = _scheduler()
    _add(scheduler, "lora", A)
    _add(scheduler, "base", None)
    plan = scheduler.schedule()
    assert plan.load_loras == (A,) and not plan.wait_for_loads
    assert _scheduled(plan) == {"base"}
    scheduler.update_from_output(_result(plan))  # not read yet
    plan = scheduler.schedule()
    assert _scheduled(plan) == {"base"} and plan.load_loras == ()  # asked for once
    scheduler.update_from_output(_result(plan, loaded_loras=(1,)))
    assert [new.lora for new in scheduler.schedule().new_sequences] == [A]


def test_with_nothing_else_to_run_a_plan_waits_for_the_read():
    scheduler = _scheduler()
    _add(scheduler, "lora", A)
    poll = scheduler.schedule()
    assert poll.chunks == () and poll.wait_for_loads and poll.load_loras == (A,)
    assert not scheduler.schedule().wait_for_loads  # one poll out at a time
    assert scheduler.update_from_output(_result(poll)) == []  # nothing read within its wait
    poll = scheduler.schedule()
    assert poll.wait_for_loads and poll.load_loras == ()
    scheduler.update_from_output(_result(poll, loaded_loras=(1,)))
    plan = scheduler.schedule()
    assert _scheduled(plan) == {"lora"} and not plan.wait_for_loads


def test_max_loras_adapters_run_at_once_and_only_the_base_model_passes_one_that_waits():
    scheduler = _scheduler(max_loras=1)
    scheduler.lora_loads.ready.update({1, 2})
    _add(scheduler, "a", A)
    _add(scheduler, "b", B)
    _add(scheduler, "a-later", A)  # would take no slot, but must not pass "b"
    _add(scheduler, "base", None)
    plan = scheduler.schedule()
    assert _scheduled(plan) == {"a", "base"}
    assert scheduler.statistics().waiting_lora_adapters == ("a", "b")  # "a-later" waits too
    assert scheduler.statistics().running_lora_adapters == ("a",)
    while "a" in scheduler.sequences:
        scheduler.update_from_output(_result(plan))
        plan = scheduler.schedule()
    assert "b" in _scheduled(plan) and "a-later" not in _scheduled(plan)


def test_a_worker_restart_asks_for_every_adapter_again():
    scheduler = _scheduler()
    _add(scheduler, "lora", A)
    poll = scheduler.schedule()
    scheduler.update_from_output(_result(poll, loaded_loras=(1,)))
    plan = scheduler.schedule()
    assert _scheduled(plan) == {"lora"}
    scheduler.requeue_all_running()
    poll = scheduler.schedule()
    assert poll.load_loras == (A,) and poll.wait_for_loads and poll.chunks == ()


def test_an_adapter_dropped_from_host_memory_is_asked_for_again():
    scheduler = _scheduler()
    scheduler.lora_loads.ready.add(1)
    _add(scheduler, "base", None)
    plan = scheduler.schedule()
    scheduler.update_from_output(_result(plan, evicted_loras=(1,)))
    _add(scheduler, "lora", A)
    plan = scheduler.schedule()
    assert plan.load_loras == (A,) and "lora" not in _scheduled(plan)
    # read, and dropped again (the workers read another) before its sequence ran
    scheduler.update_from_output(_result(plan, loaded_loras=(1,), evicted_loras=(1,)))
    assert scheduler.schedule().load_loras == (A,)


def test_an_adapter_the_workers_could_not_read_ends_its_sequences_with_abort():
    scheduler = _scheduler(max_loras=2)
    waiting = _add(scheduler, "waiting", A)
    poll = scheduler.schedule()
    updates = scheduler.update_from_output(_result(poll, failed_loras=((1, "gone"),)))
    assert [(u.seq_id, u.finish_reason) for u in updates] == [("waiting", "abort")]
    assert waiting.status == SequenceStatus.FINISHED_ABORTED
    # one already running (its host copy dropped, then read again in a step, and that failed)
    scheduler.lora_loads.ready.update({1, 2})
    running = _add(scheduler, "running", A)
    other = _add(scheduler, "other", B)
    plan = scheduler.schedule()
    assert _scheduled(plan) == {"running", "other"}
    updates = scheduler.update_from_output(_result(plan, failed_loras=((1, "gone"),)))
    assert [(u.seq_id, u.finish_reason) for u in updates if u.finish_reason == "abort"] == [("running", "abort")]
    assert running.status == SequenceStatus.FINISHED_ABORTED
    assert other.status == SequenceStatus.RUNNING and [u.seq_id for u in updates].count("other") == 1


def test_kv_of_one_adapter_is_no_prefix_hit_for_another():
    manager = BlockManager(16, 4)
    tokens = tuple(range(1, 10))
    first = Sequence("first", tokens, PARAMS, arrival_time=0.0, max_model_len=64, lora=A)
    assert manager.allocate_slots(first, len(tokens), manager.get_computed_blocks(first)[0]) is not None
    first.num_computed_tokens = len(tokens)
    manager.cache_computed_blocks(first)
    for lora, hit in ((B, 0), (None, 0), (A, 8)):
        other = Sequence("other", tokens, PARAMS, arrival_time=1.0, max_model_len=64, lora=lora)
        assert manager.get_computed_blocks(other)[1] == hit
