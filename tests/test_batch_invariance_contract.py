"""Contract tests: batch invariance through the real engine on the default model. A greedy
request's tokens and logprobs (every top-5 value, compared as floats, not within a tolerance)
are the same alone, among the other prompts, inside a batch of 64 mixed requests, after
preemptions made it recompute, and after a worker SIGKILL made every running request
recompute: with ``batch_invariant`` on this CPU's kernels and on the AVX2 build with float32
activations (the loops over weights in GGUF's layout), and without it where the default path
is invariant as it is (int16 activations over interleaved weights, in both builds).
``--batch-invariant`` is refused, naming the reason, where no kernel honours it. The kernels
behind it are checked one by one in tests/test_batch_invariance.py; tiny float32 models of
every family are checked here in the worker's runner (alone, together, chunked,
recomputed)."""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.driver import Driver
from tests.hf_compare import TINY_MODEL_TEXTS, greedy_params
from tests.test_engine_contract import TEXTS
from triode import LLM, SamplingParams, kernels
from triode.engine.config import EngineArgs
from triode.engine.errors import ModelLoadError
from triode.engine.model_files.resolve import resolve_model
from triode.engine.worker.runner import ModelRunner
from triode.kernels.quant_linear import interleaved_kernels_available

pytestmark = [pytest.mark.contract, pytest.mark.default_model]

MAX_TOKENS = 24
# (TRIODE_CPU_ISA, batch_invariant, quantized_activations): the setting on this CPU's build and
# on the AVX2 one's float32 loops, and the default where it is invariant without the setting.
# the AVX2 build's runs are the slowest (20-30 s each): make test-all runs them
CONFIGURATIONS = [("native", True, "auto"), pytest.param("avx2", True, "float32", marks=pytest.mark.slow)] + [
    pytest.param(isa, False, "auto", marks=[pytest.mark.slow] if isa == "avx2" else [])
    for isa in ("native", "avx2") if interleaved_kernels_available()]


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)


def trace(output) -> list[tuple[int, dict[int, float]]]:
    """(token id, {top token id: logprob}) per generated token of a request's only sample."""
    sample = output.outputs[0]
    assert len(sample.token_ids) == len(sample.logprobs) == MAX_TOKENS
    return [(token, {t: lp.logprob for t, lp in top.items()})
            for token, top in zip(sample.token_ids, sample.logprobs, strict=True)]


def generate_killing_the_worker(llm: LLM, after_steps: int, prompts: list[str] = TEXTS,
                                params: SamplingParams | None = None) -> list:
    """The prompts' outputs (greedy by default), the worker SIGKILLed after ``after_steps``."""
    engine = llm.llm_engine
    for index, text in enumerate(prompts):
        engine.add_request(f"kill-{index}", text, params or greedy())
    finished, steps = {}, 0
    while engine.has_unfinished_requests():
        if steps == after_steps:
            (pid,) = engine.statistics().worker_pids
            os.kill(pid, signal.SIGKILL)
        finished.update((o.request_id, o) for o in engine.step() if o.finished)
        steps += 1
    assert engine.statistics().worker_restarts == 1
    assert len(finished) == len(prompts)
    return [finished[f"kill-{i}"] for i in range(len(prompts))]


@pytest.mark.parametrize(("isa", "batch_invariant", "activations"), CONFIGURATIONS)
def test_a_request_recomputed_or_batched_otherwise_keeps_its_logprobs(monkeypatch, isa, batch_invariant, activations):
    monkeypatch.setenv("TRIODE_CPU_ISA", isa)  # read by the worker processes
    options = {"batch_invariant": batch_invariant, "quantized_activations": activations}
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



def test_tiny_models_of_each_family_recompute_the_same_logprobs(tiny_model, tiny_tokenizer, kernel_settings):
    """Float32 models of every family with --batch-invariant, in the worker's runner: each
    prompt's logprobs decoded together are those decoded alone, recomputed as one prefill of
    prompt + output (what a preemption or a restart runs) and prefilled in 7-token chunks."""
    runner = ModelRunner(EngineArgs(model=str(tiny_model), kv_cache_memory="64MiB", max_model_len=256,
                                    batch_invariant=True), tiny_model)
    driver, prompts, steps = Driver(runner), [tiny_tokenizer.encode(text) for text in TINY_MODEL_TEXTS], 12
    together = driver.generate(prompts, greedy_params(steps), name="together")
    assert len(together) == len(prompts) >= 4
    assert driver.generate(prompts[:1], greedy_params(steps), name="alone") == together[:1]
    assert driver.generate(prompts, greedy_params(steps), chunk_size=7, name="chunked") == together
    for index, (tokens, logprobs) in enumerate(together):
        for step in (1, steps // 2, steps - 1):
            [([token], [recomputed])] = driver.generate([prompts[index] + tokens[:step]], greedy_params(1),
                                                      name=f"re-{index}-{step}")
            assert (token, recomputed) == (tokens[step], logprobs[step]), f"prompt {index}, step {step}"


def test_batch_invariant_is_refused_for_int8_activations_over_gguf_layout(kernel_settings, monkeypatch):
    path = resolve_model(None, cache_dir=EngineArgs().resolved_cache_dir()).path
    args = EngineArgs(kv_cache_memory="64MiB", max_model_len=128, batch_invariant=True, quantized_activations="int8")
    # A build without the interleaved kernels: int8 runs the loop over GGUF's layout.
    monkeypatch.setattr(kernels.quant_linear, "interleaved_kernels_available", lambda: False)
    with pytest.raises(ModelLoadError, match=r"--batch-invariant cannot be honoured: int8 activations over "
                                             r"weights in GGUF's layout"):
        ModelRunner(args, path)


_THREADS_PROBE = """
import pickle, sys
from tests.driver import Driver
from tests.hf_compare import greedy_params
from triode.engine.config import EngineArgs
from triode.engine.inputs import load_tokenizer
from triode.engine.model_files.resolve import resolve_model
from triode.engine.worker.runner import ModelRunner

path = resolve_model(None, cache_dir=EngineArgs().resolved_cache_dir()).path
runner = ModelRunner(EngineArgs(kv_cache_memory="64MiB", max_model_len=256, batch_invariant=True), path)
prompts = [load_tokenizer(path).encode(text) for text in sys.argv[1:]]
sys.stdout.buffer.write(pickle.dumps(Driver(runner).generate(prompts, greedy_params(8))))
"""


@pytest.mark.parametrize("isa", ["native", pytest.param("avx2", marks=pytest.mark.slow)])
def test_logprobs_do_not_depend_on_the_thread_count(isa):
    """The same prompts in a runner whose kernels use one thread and one with two (OpenMP's and
    torch's): the C kernels divide rows, heads and output features among threads, never a sum."""
    outputs = []
    for threads in ("1", "2"):
        env = {**os.environ, "OMP_NUM_THREADS": threads, "TRIODE_CPU_ISA": isa}
        done = subprocess.run([sys.executable, "-c", _THREADS_PROBE, *TEXTS[:4]], env=env, capture_output=True,
                              timeout=300, cwd=Path(__file__).resolve().parents[1])
        assert done.returncode == 0, done.stderr.decode()[-2000:]
        outputs.append(pickle.loads(done.stdout))
    assert len(outputs[0]) == 4
    assert outputs[0] == outputs[1]
