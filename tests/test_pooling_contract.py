"""Contract tests: embeddings from pooling models, a real worker process on tiny random Qwen3
models, against Hugging Face transformers' hidden states in float32. A bare ``Qwen3Model``
checkpoint pools its last token (normalized) by default; a causal LM converted with
``runner="pooling"`` pools as its sentence-transformers files say (mean, normalized); a batch
of mixed lengths, and prompts cut into chunks, give what one prompt at a time gives; and
requests the model does not run are refused with the field named."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModel

from tests.tiny_models import with_sentence_transformers_files
from triode import LLM, InvalidRequestError, PoolingParams, SamplingParams
from triode.engine.errors import UnsupportedModelError

PROMPTS = ["The quick brown fox", "Paris is the capital of France; Berlin is the capital of Germany. " * 3,
           "héllo", "def add(a, b):\n    return a + b\n"]
ENGINE = dict(max_model_len=256, kv_cache_memory="8MiB", dtype="float32")


@pytest.fixture(scope="module")
def causal(tiny_model_factory):
    return tiny_model_factory("qwen3")


@pytest.fixture(scope="module")
def bare(causal, tmp_path_factory):
    """The causal model's decoder alone, saved as transformers saves a ``Qwen3Model``."""
    directory = tmp_path_factory.mktemp("qwen3-model")
    AutoModel.from_pretrained(causal).save_pretrained(directory, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (directory / name).write_bytes((causal / name).read_bytes())
    assert json.loads((directory / "config.json").read_text())["architectures"] == ["Qwen3Model"]
    return directory


def hf_hidden(path, tokenizer, prompt: str) -> torch.Tensor:
    model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.inference_mode():
        return model(ids).last_hidden_state[0]


def vectors(outputs) -> list[torch.Tensor]:
    return [torch.tensor(o.outputs.embedding) for o in outputs]


def test_a_bare_decoder_embeds_its_last_token_normalized(bare, tiny_tokenizer):
    with LLM(str(bare), **ENGINE) as llm:
        batch = llm.embed(PROMPTS, use_tqdm=False)
        alone = [llm.embed(prompt, use_tqdm=False)[0] for prompt in PROMPTS]
        cut = llm.embed(PROMPTS[1], PoolingParams(dimensions=16, normalize=False), use_tqdm=False)[0]
        with pytest.raises(InvalidRequestError) as caught:
            llm.generate("Hi", SamplingParams(max_tokens=2), use_tqdm=False)
        assert caught.value.field == "model"
        with pytest.raises(InvalidRequestError) as too_wide:
            llm.embed("Hi", PoolingParams(dimensions=65), use_tqdm=False)
        assert too_wide.value.field == "dimensions"
        with pytest.raises(InvalidRequestError) as too_long:
            llm.embed([list(range(5, 305))], use_tqdm=False)
        assert too_long.value.field == "prompt"
        truncated = llm.embed([list(range(5, 305))], truncate_prompt_tokens=-1, use_tqdm=False)[0]
        last = llm.embed([list(range(49, 305))], use_tqdm=False)[0]
    assert len(batch) == len(alone) == len(PROMPTS)
    for prompt, output, single in zip(PROMPTS, batch, alone, strict=True):
        expected = F.normalize(hf_hidden(bare, tiny_tokenizer, prompt)[-1], dim=-1)
        assert output.prompt == prompt and len(output.outputs.embedding) == 64
        torch.testing.assert_close(torch.tensor(output.outputs.embedding), expected, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(torch.tensor(single.outputs.embedding), torch.tensor(output.outputs.embedding),
                                   atol=1e-6, rtol=0)
    unnormalized = hf_hidden(bare, tiny_tokenizer, PROMPTS[1])[-1][:16]
    torch.testing.assert_close(torch.tensor(cut.outputs.embedding), unnormalized, atol=1e-5, rtol=1e-4)
    assert len(truncated.prompt_token_ids) == 256
    assert truncated.outputs.embedding == last.outputs.embedding


def test_a_converted_causal_lm_pools_as_its_sentence_transformers_files_say(causal, tiny_tokenizer, tmp_path):
    model = with_sentence_transformers_files(causal, tmp_path / "st-model", "MEAN")
    # Chunks of 16 tokens: the longer prompts run over several steps, the mean spans them.
    with LLM(str(model), runner="pooling", max_num_batched_tokens=16, **ENGINE) as llm:
        batch = vectors(llm.embed(PROMPTS, use_tqdm=False))
    assert len(batch) == len(PROMPTS)
    for prompt, vector in zip(PROMPTS, batch, strict=True):
        expected = F.normalize(hf_hidden(causal, tiny_tokenizer, prompt).mean(dim=0), dim=-1)
        torch.testing.assert_close(vector, expected, atol=1e-5, rtol=1e-4)


def test_runner_choices(causal, bare):
    with LLM(str(causal), **ENGINE) as llm, pytest.raises(InvalidRequestError) as caught:
        llm.embed("Hi", use_tqdm=False)
    assert caught.value.field == "model"
    with pytest.raises(UnsupportedModelError, match="no language-model head"):
        LLM(str(bare), runner="generate", **ENGINE)
    with pytest.raises(UnsupportedModelError, match="--convert embed"):
        LLM(str(causal), runner="pooling", convert="none", **ENGINE)
