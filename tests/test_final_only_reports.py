"""Unit tests: a final-only sequence with nothing to find in its text reports its first token
and then the rest at its end (``Sequence.reports_at_end``), and its final output is the same as
one built step by step: its tokens, its text, its first token's time; stop strings and logprobs
keep the step-by-step reports; an abort, by the user or for an adapter the workers could not
read, hands the output side the tokens it had not seen."""

from __future__ import annotations

import attrs
import pytest

from tests.fake_tokenizer import BracketTokenizer
from triode.engine.core.engine_core import EngineCore
from triode.engine.core.kv_blocks import BlockManager
from triode.engine.core.output_processor import OutputProcessor
from triode.engine.core.scheduler import Scheduler
from triode.engine.lora.request import LoRARequest
from triode.engine.sampling_params import OutputKind, SamplingParams
from triode.engine.worker_messages import SampledTokens, StepResult

PROMPT = (1, 2, 3)
FINAL = SamplingParams(max_tokens=5, ignore_eos=True, output_kind=OutputKind.FINAL_ONLY)


class _Engine:
    """The sans-IO core and the output side, driven as the engines drive them (an abort as the
    output actor takes it: the unreported tokens, then the abort); token ``10 + k``
    is sampled at step ``k`` (and its time is ``k``)."""

    def __init__(self, enable_lora: bool = False) -> None:
        scheduler = Scheduler(BlockManager(64, 4, True), max_num_seqs=8, max_num_batched_tokens=64,
                              max_loras=1 if enable_lora else None)
        self.core = EngineCore(scheduler, max_model_len=64, eos_token_ids=(0,))
        self.outputs = OutputProcessor(BracketTokenizer())
        self.reported: dict[str, list[tuple[int, ...]]] = {}  # each step's new tokens, per request
        self.finished: dict = {}
        self.step_index = 0

    def add(self, request_id: str, params: SamplingParams, lora: LoRARequest | None = None) -> None:
        seq_ids = self.core.add_request(request_id, PROMPT, params, arrival_time=0.0, lora_request=lora)
        self.outputs.add_request(request_id, prompt=None, prompt_token_ids=PROMPT, params=params,
                                 seq_ids=seq_ids, arrival_time=0.0)
        self.reported[request_id] = []

    def step(self, **result_fields) -> None:
        self.step_index += 1
        plan = self.core.schedule(float(self.step_index))
        assert plan is not None
        seq_ids = tuple(c.seq_id for c in plan.chunks if c.sample)
        result = StepResult(step_id=plan.step_id,
                            sampled=SampledTokens(seq_ids, (10 + self.step_index,) * len(seq_ids)), **result_fields)
        updates = self.core.update_from_output(result, float(self.step_index))
        self.apply(updates, float(self.step_index))

    def apply(self, updates, now: float) -> None:
        for update in updates:
            self.reported[update.request_id].append(update.new_token_ids)
        for output in self.outputs.process(updates, now).outputs:
            self.finished[output.request_id] = output

    def abort(self, request_id: str, now: float) -> None:
        unreported = self.core.unreported_updates([request_id])
        assert self.core.abort_requests([request_id]) == [request_id]
        self.apply(unreported, now)
        self.finished[request_id] = self.outputs.abort(request_id, now)


def test_a_final_only_sequence_reports_its_first_token_then_the_rest_at_its_end():
    engine = _Engine()
    engine.add("final", FINAL)
    engine.add("cumulative", attrs.evolve(FINAL, output_kind=OutputKind.CUMULATIVE))
    for _ in range(5):
        engine.step()
    assert len(engine.reported["final"]) == 2
    assert engine.reported["final"] == [(11,), (12, 13, 14, 15)]
    assert len(engine.reported["cumulative"]) == 5  # one report a step, as before
    final, cumulative = engine.finished["final"], engine.finished["cumulative"]
    assert final.outputs[0].token_ids == cumulative.outputs[0].token_ids == (11, 12, 13, 14, 15)
    assert final.outputs[0].text == cumulative.outputs[0].text == "<11><12><13><14><15>"
    assert final.outputs[0].finish_reason == "length"
    assert final.metrics.first_token_time == cumulative.metrics.first_token_time == 1.0
    assert final.metrics.last_token_time == cumulative.metrics.last_token_time == 5.0


@pytest.mark.parametrize("fields", [{"stop": ["<99>"]}, {"logprobs": 0}, {"prompt_logprobs": 0}])
def test_stop_strings_and_logprobs_keep_the_step_by_step_reports(fields):
    engine = _Engine()
    engine.add("r", attrs.evolve(FINAL, **fields))
    for _ in range(5):
        engine.step()
    assert len(engine.reported["r"]) == 5
    assert engine.finished["r"].outputs[0].token_ids == (11, 12, 13, 14, 15)


def test_an_aborted_final_only_request_ends_with_every_token_it_sampled():
    engine = _Engine()
    engine.add("r", FINAL)
    for _ in range(3):
        engine.step()
    assert engine.reported["r"] == [(11,)]
    engine.abort("r", 3.5)
    assert engine.reported["r"] == [(11,), (12, 13)]
    output = engine.finished["r"]
    assert output.outputs[0].token_ids == (11, 12, 13)
    assert output.outputs[0].text == "<11><12><13>"
    assert output.outputs[0].finish_reason == "abort"
    assert engine.core.unreported_updates(["r"]) == []  # gone with the abort


def test_an_adapter_the_workers_could_not_read_ends_its_sequences_with_their_tokens():
    adapter = LoRARequest("a", 1, "/adapters/a")
    engine = _Engine(enable_lora=True)
    engine.add("r", FINAL, lora=adapter)
    engine.step(loaded_loras=(1,))  # a plan that only waits for the read: nothing sampled
    for _ in range(3):
        engine.step()
    assert engine.reported["r"] == [(12,)]
    engine.step(failed_loras=((1, "its files changed"),))  # the step's own token is dropped
    assert engine.reported["r"] == [(12,), (13, 14)]
    output = engine.finished["r"]
    assert output.outputs[0].token_ids == (12, 13, 14)
    assert output.outputs[0].finish_reason == "abort"
