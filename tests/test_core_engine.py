"""Unit tests: the sans-IO engine core (triode.engine.core.engine_core) that both drivers run:
admission all or none, aborts by the user's id, stop-string finishes, every end-of-sequence
id, the step cycle with its failure path and idle-time accounting, the step pipeline (steps out
with their tickets, dropped on a failure), pooling requests (chunked, planned ahead,
recomputed); and the output side's vLLM-shaped logprobs (triode.engine.core.output_processor)."""

from __future__ import annotations

import pytest

from tests.fake_tokenizer import BracketTokenizer
from triode.engine.core.engine_core import EngineCore
from triode.engine.core.kv_blocks import BlockManager
from triode.engine.core.output_processor import OutputProcessor
from triode.engine.core.scheduler import Scheduler
from triode.engine.core.scheduler_output import SequenceUpdate
from triode.engine.errors import InvalidRequestError
from triode.engine.outputs import EmbeddingRequestOutput, Logprob
from triode.engine.pooling_params import PoolingParams
from triode.engine.sampling_params import OutputKind, SamplingParams
from triode.engine.worker_messages import (
    PooledOutput,
    SampledTokens,
    StepPlan,
    StepResult,
    TokenLogprobs,
)

EOS_IDS = (7, 8, 9)  # the model's own first


def make_core(num_blocks: int = 32, block_size: int = 4, max_model_len: int = 64) -> EngineCore:
    scheduler = Scheduler(BlockManager(num_blocks, block_size, True), max_num_seqs=16,
                          max_num_batched_tokens=256)
    return EngineCore(scheduler, max_model_len=max_model_len, eos_token_ids=EOS_IDS)


def params(**fields) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 8, **fields})


def result_for(plan: StepPlan, tokens: dict[str, int]) -> StepResult:
    """Samples ``tokens[seq_id]`` (default 1) for every chunk of the plan that samples."""
    seq_ids = tuple(c.seq_id for c in plan.chunks if c.sample)
    return StepResult(step_id=plan.step_id,
                      sampled=SampledTokens(seq_ids, tuple(tokens.get(seq_id, 1) for seq_id in seq_ids)))


def test_a_request_with_a_colliding_sample_id_is_rejected_whole():
    core = make_core()
    assert core.add_request("x-1", [1, 2, 3], params(), arrival_time=0.0) == ("x-1",)
    with pytest.raises(InvalidRequestError, match="sample 1 of 'x'") as error:
        core.add_request("x", [1, 2, 3], params(n=3), arrival_time=0.0)
    assert error.value.field == "request_id"
    assert list(core.scheduler.sequences) == ["x-1"]  # x-0 was not admitted either
    assert list(core.scheduler.families) == ["x-1"]
    with pytest.raises(InvalidRequestError, match="already in use"):
        core.add_request("x-1", [4], params(), arrival_time=0.0)


def test_a_request_too_big_for_the_cache_leaves_nothing_behind():
    core = make_core(num_blocks=4, block_size=4, max_model_len=64)  # 16 tokens of KV
    with pytest.raises(InvalidRequestError) as error:
        core.add_request("big", [1] * 10, params(n=2, max_tokens=20), arrival_time=0.0)
    assert error.value.field == "max_tokens"
    assert not core.has_unfinished_requests() and core.statistics().kv_blocks_free == 4


def test_abort_takes_user_ids_and_reaches_every_sample():
    core = make_core()
    core.add_request("p", [1, 2, 3, 4, 5], params(n=2), arrival_time=0.0)
    core.add_request("p-1-x", [1, 2], params(), arrival_time=0.0)
    assert core.abort_requests(["p-1", "p", "unknown"]) == ["p"]  # "p-1" is a sample, not a request
    assert list(core.scheduler.sequences) == ["p-1-x"]


def test_every_end_of_sequence_id_stops_and_names_itself_but_the_models_own():
    core = make_core()
    for request_id, eos in [("own", 7), ("second", 8), ("third", 9)]:
        core.add_request(request_id, [1, 2, 3], params(), arrival_time=0.0)
        plan = core.schedule(0.0)
        (update,) = core.update_from_output(result_for(plan, {request_id: eos}), 1.0)
        assert (update.finish_reason, update.stop_reason) == ("stop", None if eos == 7 else eos)
    assert core.schedule(2.0) is None  # nothing is left to run


def test_min_tokens_and_ignore_eos_hold_off_every_end_of_sequence_id():
    core = make_core()
    core.add_request("a", [1, 2], params(min_tokens=2), arrival_time=0.0)
    core.add_request("b", [3, 4], params(ignore_eos=True, max_tokens=2), arrival_time=0.0)
    plan = core.schedule(0.0)
    # The worker bans them until min_tokens are out (and never checks them with ignore_eos).
    assert [n.eos_token_ids for n in plan.new_sequences] == [EOS_IDS, EOS_IDS]
    updates = core.update_from_output(result_for(plan, {"a": 8, "b": 9}), 1.0)
    assert [u.finish_reason for u in updates] == [None, None]
    updates = core.update_from_output(result_for(core.schedule(1.0), {"a": 9, "b": 9}), 2.0)
    assert [(u.finish_reason, u.stop_reason) for u in updates] == [("stop", 9), ("length", None)]


def test_stop_string_finish_during_a_step_drops_its_token():
    core = make_core()
    core.add_request("a", [1, 2, 3], params(), arrival_time=0.0)
    plan = core.schedule(0.0)
    core.finish_on_stop_string("a", "###")
    assert core.update_from_output(result_for(plan, {}), 1.0) == []
    assert not core.has_unfinished_requests()
    assert core.schedule(2.0) is None


def test_a_failed_step_recomputes_everything_that_ran():
    core = make_core()
    core.add_request("a", [1, 2, 3], params(), arrival_time=0.0)
    core.update_from_output(result_for(core.schedule(0.0), {}), 1.0)
    core.schedule(1.5)
    (requeued,) = core.step_failed()
    assert requeued.seq_id == "a" and requeued.num_computed_tokens == 0
    plan = core.schedule(5.0)  # the idle clock restarted with the failure: nothing counted
    assert [n.output_token_ids for n in plan.new_sequences] == [(1,)]
    assert core.idle_seconds == pytest.approx(0.5)


def test_the_pipeline_keeps_two_steps_out_with_async_scheduling_and_drops_them_on_a_failure():
    scheduler = Scheduler(BlockManager(32, 4, True), max_num_seqs=16, max_num_batched_tokens=256,
                          max_steps_in_flight=2)
    core = EngineCore(scheduler, max_model_len=64, eos_token_ids=EOS_IDS)
    core.add_request("a", [1, 2, 3], params(), arrival_time=0.0)
    sent: list[StepPlan] = []

    def send(plan: StepPlan) -> str:
        sent.append(plan)
        return f"ticket {plan.step_id}"

    core.send_steps(send, 0.5)
    assert len(sent) == 2  # the next step planned while the first runs
    assert [step.ticket for step in core.steps_sent()] == [f"ticket {p.step_id}" for p in sent]
    step, updates = core.complete_step(result_for(sent[0], {"a": 4}), 1.0, send)
    assert step.plan is sent[0] and step.started == 0.5 and [u.new_token_ids for u in updates] == [(4,)]
    assert core.oldest_step().plan is sent[1]
    # the step after it went out with the result, before the driver builds its outputs
    assert len(sent) == 3 and len(core.steps_sent()) == 2 and core.steps_sent()[1].started == 1.0
    (requeued,) = core.step_failed()
    assert core.oldest_step() is None and core.steps_sent() == ()
    assert requeued.seq_id == "a" and requeued.num_computed_tokens == 0
    core.send_steps(send, 2.0)
    assert len(sent) == 5 and [n.output_token_ids for n in sent[3].new_sequences] == [(4,)]


def test_idle_time_counts_only_between_steps_with_work_left():
    core = make_core()
    core.add_request("a", [1, 2, 3], params(max_tokens=2), arrival_time=0.0)
    core.update_from_output(result_for(core.schedule(0.0), {}), 1.0)
    core.update_from_output(result_for(core.schedule(1.25), {}), 2.0)  # finishes: nothing left
    core.add_request("b", [1, 2, 3], params(max_tokens=1), arrival_time=10.0)
    core.update_from_output(result_for(core.schedule(10.0), {}), 11.0)
    assert core.idle_seconds == pytest.approx(0.25)


def test_logprobs_come_out_as_vllm_dicts_with_the_chosen_token_first():
    processor = OutputProcessor(BracketTokenizer())
    processor.add_request("r", prompt="p", prompt_token_ids=(1, 2, 3),
                          params=SamplingParams(logprobs=2, prompt_logprobs=1, output_kind=OutputKind.FINAL_ONLY),
                          seq_ids=("r",), arrival_time=0.0)
    prompt = (TokenLogprobs(token_id=2, logprob=-1.0, rank=2, top=((5, -0.5),)),
              TokenLogprobs(token_id=3, logprob=-0.25, rank=1, top=((3, -0.25),)))
    chosen = TokenLogprobs(token_id=6, logprob=-3.0, rank=4, top=((4, -0.1), (5, -0.2)))
    among = TokenLogprobs(token_id=4, logprob=-0.1, rank=1, top=((4, -0.1), (5, -0.2)))
    processor.process([SequenceUpdate(seq_id="r", request_id="r", index=0, new_token_ids=(6,),
                                      logprobs=(chosen,), prompt_logprobs=prompt)], 1.0)
    (output,) = processor.process([SequenceUpdate(seq_id="r", request_id="r", index=0, new_token_ids=(4,),
                                                  logprobs=(among,), finish_reason="length")], 2.0).outputs
    first, second = output.outputs[0].logprobs
    assert list(first) == [6, 4, 5] and first[6] == Logprob(-3.0, 4, "<6>")
    assert first[4] == Logprob(-0.1, 1, "<4>") and first[5].rank == 2
    assert list(second) == [4, 5] and second[4].rank == 1
    assert output.outputs[0].cumulative_logprob == pytest.approx(-3.1)
    assert output.prompt_logprobs[0] is None and len(output.prompt_logprobs) == 3
    assert output.prompt_logprobs[1][2] == Logprob(-1.0, 2, "<2>")
    assert list(output.prompt_logprobs[2]) == [3]


def pooled_for(plan: StepPlan) -> StepResult:
    """Embeds every pooling sequence whose prompt the plan ends: its seq id's length, as a vector."""
    return StepResult(step_id=plan.step_id, pooled=tuple(
        PooledOutput(c.seq_id, (float(len(c.seq_id)),)) for c in plan.chunks if c.sample))


@pytest.mark.parametrize("steps_in_flight", [1, 2])
def test_a_pooling_request_runs_its_prompt_in_chunks_then_ends_with_its_embedding(steps_in_flight):
    scheduler = Scheduler(BlockManager(32, 4, False), max_num_seqs=16, max_num_batched_tokens=6,
                          max_steps_in_flight=steps_in_flight)
    core = EngineCore(scheduler, max_model_len=64, eos_token_ids=EOS_IDS, runner="pooling")
    with pytest.raises(InvalidRequestError, match="pooling model"):
        core.add_request("gen", [1, 2], params(), arrival_time=0.0)
    core.add_request("emb", list(range(10, 25)), PoolingParams(), arrival_time=0.0)  # 15 tokens: 3 chunks
    plans = []
    while core.can_schedule() and (plan := core.schedule(now=0.0)) is not None:
        plans.append(plan)
    assert len(plans) == steps_in_flight
    assert plans[0].new_sequences[0].pooling == PoolingParams()
    updates = []
    while plans:
        updates += core.update_from_output(pooled_for(plans.pop(0)), now=0.0)
        while core.can_schedule() and (plan := core.schedule(now=0.0)) is not None:
            plans.append(plan)
    assert len(updates) == 1
    (update,) = updates
    assert (update.request_id, update.finish_reason, update.embedding, update.new_token_ids) == (
        "emb", "stop", (3.0,), ())
    assert not core.has_unfinished_requests() and core.statistics().kv_blocks_free == 32


def test_a_pooling_request_is_recomputed_after_a_lost_step_and_its_output_built_once():
    core = EngineCore(Scheduler(BlockManager(32, 4, False), max_num_seqs=16, max_num_batched_tokens=64),
                      max_model_len=64, eos_token_ids=EOS_IDS, runner="pooling")
    outputs = OutputProcessor(tokenizer=None)
    core.add_request("emb", [5, 6, 7], PoolingParams(dimensions=1), arrival_time=0.0)
    outputs.add_request("emb", prompt="x", prompt_token_ids=[5, 6, 7], params=PoolingParams(dimensions=1),
                        seq_ids=("emb",), arrival_time=0.0)
    core.schedule(now=0.0)
    assert [s.seq_id for s in core.step_failed()] == ["emb"]
    plan = core.schedule(now=1.0)
    assert [s.seq_id for s in plan.new_sequences] == ["emb"]  # the worker starts it anew
    step = outputs.process(core.update_from_output(pooled_for(plan), now=2.0), now=2.0)
    (output,) = step.outputs
    assert isinstance(output, EmbeddingRequestOutput) and output.outputs.embedding == [3.0]
    assert output.prompt_token_ids == (5, 6, 7) and not outputs.pooling
    with pytest.raises(InvalidRequestError, match="generates text"):
        make_core().add_request("e", [1], PoolingParams(), arrival_time=0.0)


def test_an_encoders_prompts_run_whole_and_wait_rather_than_being_cut():
    scheduler = Scheduler(BlockManager(32, 4, False), max_num_seqs=16, max_num_batched_tokens=10,
                          whole_prompts=True, long_prefill_token_threshold=2)
    core = EngineCore(scheduler, max_model_len=10, eos_token_ids=EOS_IDS, runner="pooling")
    for name, length in (("a", 6), ("b", 6), ("c", 3)):
        core.add_request(name, list(range(1, length + 1)), PoolingParams(), arrival_time=0.0)
    first = core.schedule(now=0.0)
    assert [(c.seq_id, len(c.token_ids), c.sample) for c in first.chunks] == [("a", 6, True)]  # b waits, c too
    core.update_from_output(pooled_for(first), now=0.0)
    second = core.schedule(now=0.0)
    assert [(c.seq_id, len(c.token_ids)) for c in second.chunks] == [("b", 6), ("c", 3)]
