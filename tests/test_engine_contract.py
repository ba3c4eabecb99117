"""Contract tests: the real engine (worker processes, the default model) through LLM,
LLMEngine and AsyncLLM, against Hugging Face's greedy output; chunked prefill and
preemption under a tiny budget; a worker SIGKILL mid-batch; no KV block left behind."""

from __future__ import annotations

import os
import signal

import pytest
import trio

from tests.hf_compare import hf_greedy
from triode import LLM, AsyncLLM, EngineArgs, SamplingParams
from triode.engine.errors import InvalidRequestError

pytestmark = [pytest.mark.contract, pytest.mark.default_model]

MAX_TOKENS = 16
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


@pytest.fixture(scope="module")
def default_path():
    from triode.engine.model_files.resolve import resolve_model

    return resolve_model(None, cache_dir=EngineArgs().resolved_cache_dir()).path


@pytest.fixture(scope="module")
def prompts(default_path):
    from triode.engine.inputs import load_tokenizer

    tokenizer = load_tokenizer(default_path)
    return [tokenizer.encode(text) for text in TEXTS]


@pytest.fixture(scope="module")
def reference(default_path, prompts):
    return [tokens for tokens, _ in hf_greedy(default_path, prompts, MAX_TOKENS)]


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def assert_all_blocks_free(stats) -> None:
    assert stats.kv_blocks_free == stats.kv_blocks_total, stats


@pytest.fixture(scope="module")
def llm():
    with LLM(kv_cache_memory="256MiB", max_model_len=1024) as engine:
        yield engine


def test_llm_generate_matches_hf(llm, prompts, reference):
    outputs = llm.generate(prompts, greedy(), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == reference
    assert_all_blocks_free(llm.llm_engine.statistics())


def test_reset_prefix_cache_makes_a_repeated_prompt_compute_again(llm, prompts, reference):
    long_prompt = prompts[5]  # the one longer than a block
    first, again = (llm.generate([long_prompt], greedy(), use_tqdm=False)[0] for _ in range(2))
    assert again.num_cached_tokens > 0
    assert llm.reset_prefix_cache() is True
    after = llm.generate([long_prompt], greedy(), use_tqdm=False)[0]
    assert after.num_cached_tokens == 0
    assert [list(o.outputs[0].token_ids) for o in (first, again, after)] == [reference[5]] * 3


def test_llm_chat_answers(llm):
    (output,) = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0.0, max_tokens=12),
        use_tqdm=False,
    )
    assert output.outputs[0].text.startswith("The capital of France is Paris")
    assert_all_blocks_free(llm.llm_engine.statistics())


def test_bad_input_raises_typed_errors_and_leaves_nothing_queued(llm):
    for prompt, params, field in [
        ("", greedy(), "prompt"),
        ([1, 2, 10**9], greedy(), "prompt"),
        ("x " * 2000, greedy(), "prompt"),
        ("hello", SamplingParams(logit_bias={10**9: 1.0}), "logit_bias"),
        ({"prompt": "hello", "prompt_ids": [1]}, greedy(), "prompt"),
        ({"prompt_token_ids": "hello"}, greedy(), "prompt"),
    ]:
        with pytest.raises(InvalidRequestError) as error:
            llm.generate(["a good prompt first", prompt], params, use_tqdm=False)
        assert error.value.field == field
    chat = [{"role": "user", "content": "Hi"}]
    for options, field in [({"chat_template": "{{ raise_exception('no') }}"}, "chat_template"),
                           ({"chat_template_kwargs": "enable_thinking"}, "chat_template_kwargs")]:
        with pytest.raises(InvalidRequestError) as error:
            llm.chat(chat, greedy(), use_tqdm=False, **options)
        assert error.value.field == field
    for field, options in [("max_tokens", {"max_tokens": 0}), ("n", {"n": 0}), ("top_p", {"top_p": 1.5}),
                           ("temperature", {"temperature": -1.0}), ("seed", {"seed": 2**63})]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**options)
    # The batch's shape: each once a bare TypeError or ValueError, and a priority that reached
    # the scheduler's queue left every later call failing.
    for call, field in [(lambda: llm.generate(None, greedy()), "prompt"),
                        (lambda: llm.generate(b"hello", greedy()), "prompt"),
                        (lambda: llm.generate(["a", "b"], [greedy()]), "sampling_params"),
                        (lambda: llm.generate("a", {"max_tokens": 2}), "sampling_params"),
                        (lambda: llm.generate("a", greedy(), lora_request="x"), "lora_request"),
                        (lambda: llm.generate(["a", "b", "c"], greedy(), priority=[1, "x", 2]), "priority")]:
        with pytest.raises(InvalidRequestError) as error:
            call()
        assert error.value.field == field
    assert not llm.llm_engine.has_unfinished_requests()
    assert len(llm.generate(["a", "b"], greedy(), use_tqdm=False)) == 2


def test_a_colliding_sample_id_rejects_the_request_whole(llm, prompts, reference):
    engine = llm.llm_engine
    engine.add_request("x-1", prompts[0], greedy())
    with pytest.raises(InvalidRequestError, match="sample 1 of 'x'") as error:
        engine.add_request("x", prompts[1], SamplingParams(n=2, max_tokens=4))
    assert error.value.field == "request_id"
    stats = engine.statistics()
    assert stats.num_running + stats.num_waiting == 1
    finished = {}
    while engine.has_unfinished_requests():
        finished.update((o.request_id, o) for o in engine.step() if o.finished)
    assert list(finished) == ["x-1"] and list(finished["x-1"].outputs[0].token_ids) == reference[0]


def test_tiny_budget_forces_chunked_prefill_and_preemption(prompts, reference):
    # 12 blocks of 16 tokens cannot hold 8 sequences of ~20-60 tokens at once.
    with LLM(kv_cache_memory=12 * 16 * 30 * 2 * 3 * 64 * 4, max_model_len=128,
             max_num_batched_tokens=32, long_prefill_token_threshold=16) as small:
        outputs = small.generate(prompts, greedy(), use_tqdm=False)
        stats = small.llm_engine.statistics()
    assert [list(o.outputs[0].token_ids) for o in outputs] == reference
    assert stats.num_preemptions > 0
    assert_all_blocks_free(stats)


def test_worker_sigkill_mid_batch_loses_nothing(llm, prompts, reference):
    engine = llm.llm_engine
    for index, prompt in enumerate(prompts):
        engine.add_request(f"kill-{index}", prompt, greedy())
    finished = {}
    steps = 0
    while engine.has_unfinished_requests():
        if steps == 4:
            (pid,) = engine.statistics().worker_pids
            os.kill(pid, signal.SIGKILL)
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = list(output.outputs[0].token_ids)
        steps += 1
    assert [finished[f"kill-{i}"] for i in range(len(prompts))] == reference
    stats = engine.statistics()
    assert stats.worker_restarts == 1
    assert_all_blocks_free(stats)


async def test_async_llm_streams_match_and_cancel_frees_blocks(prompts, reference):
    async with AsyncLLM.open(EngineArgs(kv_cache_memory="256MiB", max_model_len=1024)) as llm:
        results = {}

        async def run(index: int) -> None:
            async for output in llm.generate(prompts[index], greedy(), request_id=f"a{index}"):
                results[index] = list(output.outputs[0].token_ids)

        async with trio.open_nursery() as nursery:
            for index in range(len(prompts)):
                nursery.start_soon(run, index)
            with trio.move_on_after(1.0):
                async for _ in llm.generate("Tell me a long story.", SamplingParams(max_tokens=500)):
                    pass
        assert [results[i] for i in range(len(prompts))] == reference
        # The abort takes effect before the next step, and a step may be in flight when the
        # consumer is cancelled: one more request makes sure a step has started since.
        async for _ in llm.generate(prompts[0], SamplingParams(max_tokens=1)):
            pass
        assert_all_blocks_free(llm.statistics())
