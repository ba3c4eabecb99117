"""Contract and HTTP tests: the engine end to end on a tiny random model of each architecture
family beyond the Llama one: ``LLM.generate`` (worker processes) and ``triode serve`` through
the real openai SDK, both against Hugging Face's greedy output; and a model windowed on every
layer running a sequence far longer than its KV cache holds."""

from __future__ import annotations

import openai
import pytest

from tests.hf_compare import TINY_MODEL_TEXTS, hf_greedy
from tests.http_server import running, triode_serve
from triode import LLM, SamplingParams

pytestmark = pytest.mark.contract

MAX_TOKENS = 24
# architecture, config overrides (tests/tiny_models.py holds each family's own)
FAMILIES = {
    "gemma2": ("gemma2", {}),
    "gemma3": ("gemma3", {}),
    "mistral-windowed": ("mistral", {"sliding_window": 5}),
    "phi3": ("phi3", {}),
    "mixtral": ("mixtral", {}),
    "qwen3-moe": ("qwen3_moe", {}),
}


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts(tiny_tokenizer):
    return [tiny_tokenizer.encode(text) for text in TINY_MODEL_TEXTS]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_llm_generate_matches_hf(tiny_model_factory, prompts, family):
    architecture, overrides = FAMILIES[family]
    path = tiny_model_factory(architecture, **overrides)
    reference = [tokens for tokens, _ in hf_greedy(path, prompts, MAX_TOKENS)]
    with LLM(model=str(path), kv_cache_memory="16MiB", max_model_len=256) as llm:
        outputs = llm.generate(prompts, _greedy(MAX_TOKENS), use_tqdm=False)
    assert [list(output.outputs[0].token_ids) for output in outputs] == reference


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_triode_serve_answers_as_hf_does(tiny_model_factory, tiny_tokenizer, prompts, family):
    architecture, overrides = FAMILIES[family]
    path = tiny_model_factory(architecture, **overrides)
    (reference, _), = hf_greedy(path, [prompts[2]], MAX_TOKENS)
    with running(triode_serve(path, "--served-model-name", "tiny", "--kv-cache-memory", "16MiB",
                              "--max-model-len", "256")) as server, \
            openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as client:
        completion = client.completions.create(model="tiny", prompt=prompts[2], max_tokens=MAX_TOKENS,
                                               temperature=0.0, extra_body={"ignore_eos": True})
        streamed = "".join(chunk.choices[0].text for chunk in client.completions.create(
            model="tiny", prompt=prompts[2], max_tokens=MAX_TOKENS, temperature=0.0, stream=True,
            extra_body={"ignore_eos": True}))
    assert completion.choices[0].text == streamed == tiny_tokenizer.decode(reference)
    assert completion.usage.completion_tokens == MAX_TOKENS


def test_every_layer_windowed_runs_past_the_kv_cache(tiny_model_factory, tiny_tokenizer):
    path = tiny_model_factory("mistral", sliding_window=5)
    prompt = tiny_tokenizer.encode(TINY_MODEL_TEXTS[2])
    assert len(prompt) == 64
    (reference, _), = hf_greedy(path, [prompt], 300)
    # 2 layers x 1 KV head x 16 dims x float32 x (K, V): 256 bytes a token, 4 KiB a block of
    # 16. Eight blocks hold 128 tokens, a third of the 364 this sequence reaches: its blocks
    # behind the window are freed as it goes.
    with LLM(model=str(path), kv_cache_memory=8 * 4096, max_model_len=512, max_num_batched_tokens=32) as llm:
        output, = llm.generate([prompt], _greedy(300), use_tqdm=False)
        stats = llm.llm_engine.statistics()
    assert stats.kv_blocks_total == 8
    assert list(output.outputs[0].token_ids) == reference
    assert stats.kv_blocks_free == stats.kv_blocks_total
