"""Contract tests: batch invariance through the real engine on the default model. A greedy
request's tokens and logprobs (every top-5 value, compared as floats, not within a tolerance)
are the same alone, inside a batch of 64 mixed requests, after preemptions made it recompute,
and after a worker SIGKILL made every running request recompute. The kernels behind it are
checked one by one in tests/test_batch_invariance.py."""

from __future__ import annotations

import os
import signal

import pytest

from triode import LLM, SamplingParams

pytestmark = [pytest.mark.contract, pytest.mark.default_model]

MAX_TOKENS = 24
TEXTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "def quicksort(items):",
    "The three laws of thermodynamics are",
    "List five fruits:",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who every "
    "morning walked down to the harbour before sunrise, and one day he found",
    "Translate to French: good morning",
    "1, 2, 3, 4,",
]


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)


def trace(output) -> list[tuple[int, dict[int, float]]]:
    """(token id, {top token id: logprob}) per generated token of a request's only sample."""
    sample = output.outputs[0]
    assert len(sample.token_ids) == len(sample.logprobs) == MAX_TOKENS
    return [(token, {t: lp.logprob for t, lp in top.items()})
            for token, top in zip(sample.token_ids, sample.logprobs, strict=True)]


@pytest.fixture(scope="module")
def reference():
    """Each text's trace with the prompts batched together and cache to spare."""
    with LLM(kv_cache_memory="256MiB", max_model_len=512) as llm:
        alone = trace(llm.generate(TEXTS[0], greedy(), use_tqdm=False)[0])
        together = [trace(o) for o in llm.generate(TEXTS, greedy(), use_tqdm=False)]
    assert len(together) == len(TEXTS)
    assert together[0] == alone
    return together


def test_a_request_is_the_same_inside_64_mixed_requests(reference):
    others = [f"Count from {i} to {i + 40}: " + "x " * (i % 13) for i in range(63)]
    params = [greedy()] + [SamplingParams(temperature=0.8, seed=i, max_tokens=8 + i % 40) for i in range(63)]
    with LLM(kv_cache_memory="256MiB", max_model_len=512, max_num_batched_tokens=256) as llm:
        outputs = llm.generate([TEXTS[0], *others], params, use_tqdm=False)
    assert len(outputs) == 64
    assert trace(outputs[0]) == reference[0]


def test_preempted_requests_recompute_the_same_logprobs(reference):
    # 12 blocks of 16 tokens cannot hold 8 sequences of ~20-60 tokens at once.
    with LLM(kv_cache_memory=12 * 16 * 30 * 2 * 3 * 64 * 4, max_model_len=128,
             max_num_batched_tokens=32, long_prefill_token_threshold=16) as small:
        outputs = small.generate(TEXTS, greedy(), use_tqdm=False)
        preemptions = small.llm_engine.statistics().num_preemptions
    assert preemptions > 0
    assert len(outputs) == len(TEXTS)
    assert [trace(o) for o in outputs] == reference


def test_a_worker_sigkill_recomputes_the_same_logprobs(reference):
    with LLM(kv_cache_memory="256MiB", max_model_len=512) as llm:
        engine = llm.llm_engine
        for index, text in enumerate(TEXTS):
            engine.add_request(f"kill-{index}", text, greedy())
        finished, steps = {}, 0
        while engine.has_unfinished_requests():
            if steps == 6:
                (pid,) = engine.statistics().worker_pids
                os.kill(pid, signal.SIGKILL)
            finished.update((o.request_id, o) for o in engine.step() if o.finished)
            steps += 1
        assert engine.statistics().worker_restarts == 1
    assert len(finished) == len(TEXTS)
    assert [trace(finished[f"kill-{i}"]) for i in range(len(TEXTS))] == reference
