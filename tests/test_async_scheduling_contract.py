"""Contract tests: async scheduling through the real engine (a worker process, the default
model): the same outputs with it on and off (greedy, EOS and stop strings, seeded sampling
with n > 1, logprobs, min_tokens), and aborts and a worker SIGKILL while a step planned ahead
waits behind the running one."""

from __future__ import annotations

import math

import pytest

from triode import LLM, SamplingParams
from triode.engine.outputs import RequestOutput

pytestmark = [pytest.mark.contract, pytest.mark.default_model]

TEXTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List five fruits:",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "1, 2, 3, 4,",
]
OPTIONS = dict(kv_cache_memory="256MiB", max_model_len=512)


def _params() -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=48),  # ends on EOS
        SamplingParams(temperature=0.0, max_tokens=40, stop=["\n", "Banana"], min_tokens=3),
        SamplingParams(temperature=0.8, top_p=0.9, seed=7, n=2, max_tokens=20, logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=16, stop_token_ids=[28], logprobs=1),
    ]


def _summary(output: RequestOutput) -> list[tuple]:
    return [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in output.outputs]


def _logprobs(output: RequestOutput) -> list[list[float]]:
    return [[entry[token].logprob for entry, token in zip(c.logprobs, c.token_ids, strict=True)]
            for c in output.outputs if c.logprobs is not None]


@pytest.fixture(scope="module")
def engines():
    with LLM(async_scheduling=False, **OPTIONS) as sync, LLM(async_scheduling=True, **OPTIONS) as ahead:
        yield sync, ahead


@pytest.fixture(scope="module")
def sync_outputs(engines):
    return engines[0].generate(TEXTS, _params(), use_tqdm=False)


def test_outputs_are_the_same_with_async_scheduling_on_and_off(engines, sync_outputs):
    outputs = engines[1].generate(TEXTS, _params(), use_tqdm=False)
    assert [_summary(o) for o in outputs] == [_summary(o) for o in sync_outputs]
    for ours, theirs in zip(outputs, sync_outputs, strict=True):
        for a, b in zip(_logprobs(ours), _logprobs(theirs), strict=True):
            assert all(math.isclose(x, y, abs_tol=1e-4) for x, y in zip(a, b, strict=True))
    assert {o.outputs[0].finish_reason for o in outputs} == {"length", "stop"}
    stats = engines[1].llm_engine.statistics()
    assert stats.kv_blocks_free == stats.kv_blocks_total


def _run(engine, prompts, params, *, abort_at: dict[int, str] | None = None) -> dict[str, RequestOutput]:
    for index, (prompt, sampling) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"q{index}", prompt, sampling)
    finished, steps = {}, 0
    while engine.has_unfinished_requests():
        if abort_at and steps in abort_at:
            engine.abort_request(abort_at[steps])
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
        steps += 1
    return finished


def test_with_async_scheduling_off_a_steps_outputs_are_built_while_the_next_step_runs(
        engines, sync_outputs, monkeypatch):
    engine = engines[0].llm_engine
    steps_out_when_built: list[tuple[int, bool]] = []
    process = engine.outputs.process

    def recording_process(updates, now):
        steps_out_when_built.append((engine.core.steps_in_flight, engine.core.has_unfinished_requests()))
        return process(updates, now)

    monkeypatch.setattr(engine.outputs, "process", recording_process)
    outputs = _run(engine, TEXTS, _params())
    assert [_summary(outputs[f"q{i}"]) for i in range(len(TEXTS))] == [_summary(o) for o in sync_outputs]
    longest = max(len(c.token_ids) for o in outputs.values() for c in o.outputs)
    assert len(steps_out_when_built) >= longest > 20  # one call per step
    # While sequences were left, the next step was always out (and only one: async is off).
    assert {out for out, unfinished in steps_out_when_built if unfinished} == {1}


def test_an_abort_while_a_step_is_planned_ahead_spares_the_others(engines, sync_outputs):
    ahead = engines[1].llm_engine
    params = _params()
    outputs = _run(ahead, TEXTS, params, abort_at={3: "q0", 5: "q3"})
    assert sorted(outputs) == ["q1", "q2", "q4"]  # the aborted ones end without an output
    for index in (1, 2, 4):
        assert _summary(outputs[f"q{index}"]) == _summary(sync_outputs[index])
    stats = ahead.statistics()
    assert stats.kv_blocks_free == stats.kv_blocks_total
    assert not ahead.has_unfinished_requests()


def test_a_worker_sigkill_while_a_step_is_planned_ahead_loses_nothing(sync_outputs, monkeypatch):
    # The worker kills itself as step 6 starts: step 7, planned ahead, waits behind it and is
    # dropped with it; every running sequence is recomputed on the restarted worker.
    monkeypatch.setenv("TRIODE_FAULT_PLAN", "crash@6")
    with LLM(async_scheduling=True, **OPTIONS) as llm:
        outputs = llm.generate(TEXTS, _params(), use_tqdm=False)
        stats = llm.llm_engine.statistics()
    assert [_summary(o) for o in outputs] == [_summary(o) for o in sync_outputs]
    assert stats.worker_restarts == 1
    assert stats.kv_blocks_free == stats.kv_blocks_total
