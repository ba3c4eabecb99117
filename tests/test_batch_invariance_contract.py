"""Contract tests: batch invariance through the real engine on the default model. A greedy
request's tokens and logprobs (every top-5 value, compared as floats, not within a tolerance)
are the same alone, among the other prompts, inside a batch of 64 mixed requests, after
preemptions made it recompute, and after a worker SIGKILL made every running request
recompute: with ``batch_invariant`` on this CPU's kernels and on the AVX2 build (float32
activations, the default on CPUs without AVX-512 VNNI), and without it where the default
path is invariant as it is (AVX-512 VNNI). ``--batch-invariant`` is refused, naming the
reason, for a model whose kernels cannot honour it. The kernels behind it are checked one by
one in tests/test_batch_invariance.py."""

from __future__ import annotations

import os
import signal

import pytest

from tests.test_engine_contract import TEXTS
from triode import LLM, SamplingParams
from triode.engine.config import EngineArgs
from triode.engine.errors import ModelLoadError
from triode.engine.worker.runner import ModelRunner
from triode.kernels.quant_linear import interleaved_kernels_available

pytestmark = [pytest.mark.contract, pytest.mark.default_model]

MAX_TOKENS = 24
# (TRIODE_CPU_ISA, batch_invariant): the setting on this CPU's build and on the AVX2 one, and
# the default where it is invariant without the setting.
CONFIGURATIONS = [("native", True), ("avx2", True)] + [("native", False)] * interleaved_kernels_available()


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)


def trace(output) -> list[tuple[int, dict[int, float]]]:
    """(token id, {top token id: logprob}) per generated token of a request's only sample."""
    sample = output.outputs[0]
    assert len(sample.token_ids) == len(sample.logprobs) == MAX_TOKENS
    return [(token, {t: lp.logprob for t, lp in top.items()})
            for token, top in zip(sample.token_ids, sample.logprobs, strict=True)]


def generate_killing_the_worker(llm: LLM, after_steps: int) -> list:
    engine = llm.llm_engine
    for index, text in enumerate(TEXTS):
        engine.add_request(f"kill-{index}", text, greedy())
    finished, steps = {}, 0
    while engine.has_unfinished_requests():
        if steps == after_steps:
            (pid,) = engine.statistics().worker_pids
            os.kill(pid, signal.SIGKILL)
        finished.update((o.request_id, o) for o in engine.step() if o.finished)
        steps += 1
    assert engine.statistics().worker_restarts == 1
    assert len(finished) == len(TEXTS)
    return [finished[f"kill-{i}"] for i in range(len(TEXTS))]


@pytest.mark.parametrize(("isa", "batch_invariant"), CONFIGURATIONS)
def test_a_request_recomputed_or_batched_otherwise_keeps_its_logprobs(monkeypatch, isa, batch_invariant):
    monkeypatch.setenv("TRIODE_CPU_ISA", isa)  # read by the worker processes
    options = {"batch_invariant": batch_invariant}
    others = [f"Count from {i} to {i + 40}: " + "x " * (i % 13) for i in range(63)]
    mixed = [greedy()] + [SamplingParams(temperature=0.8, seed=i, max_tokens=8 + i % 40) for i in range(63)]
    with LLM(kv_cache_memory="256MiB", max_model_len=512, max_num_batched_tokens=256, **options) as llm:
        alone = trace(llm.generate(TEXTS[0], greedy(), use_tqdm=False)[0])
        together = [trace(o) for o in llm.generate(TEXTS, greedy(), use_tqdm=False)]
        among_64 = llm.generate([TEXTS[0], *others], mixed, use_tqdm=False)
        killed = [trace(o) for o in generate_killing_the_worker(llm, after_steps=6)]
    assert len(together) == len(TEXTS) and len(among_64) == 64
    assert together[0] == alone
    assert trace(among_64[0]) == alone
    assert killed == together
    # 12 blocks of 16 tokens cannot hold 8 sequences of ~20-60 tokens at once.
    with LLM(kv_cache_memory=12 * 16 * 30 * 2 * 3 * 64 * 4, max_model_len=128, max_num_batched_tokens=32,
             long_prefill_token_threshold=16, **options) as small:
        preempted = small.generate(TEXTS, greedy(), use_tqdm=False)
        assert small.llm_engine.statistics().num_preemptions > 0
    assert [trace(o) for o in preempted] == together


def test_batch_invariant_is_refused_for_float_weights(tiny_model_factory):
    path = tiny_model_factory("llama")
    args = EngineArgs(model=str(path), kv_cache_memory="8MiB", max_model_len=64, batch_invariant=True)
    with pytest.raises(ModelLoadError, match=r"--batch-invariant cannot be honoured: its linear layers "
                                             r"include float weights .*use a GGUF file or --quantization"):
        ModelRunner(args, path)
