"""Contract tests: the encoder family (BERT, XLM-RoBERTa) as pooling models, a real worker
process on tiny random checkpoints built by transformers, against its hidden states in float32:
CLS pooling by default, mean pooling from sentence-transformers' files, bidirectional
attention (each prompt runs whole, also past a small token budget), and a batch of mixed
lengths equal to one prompt at a time."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.test_pooling_contract import PROMPTS, hf_hidden
from tests.tiny_models import ENCODERS, build_tiny_encoder, with_sentence_transformers_files
from triode import LLM

ENGINE = dict(max_model_len=128, kv_cache_memory="4MiB", dtype="float32")


@pytest.fixture(scope="module", params=sorted(ENCODERS))
def encoder(request, tiny_tokenizer, tmp_path_factory):
    return build_tiny_encoder(tmp_path_factory.mktemp(request.param), request.param, tiny_tokenizer)


def test_an_encoder_embeds_its_cls_token_and_sees_the_whole_prompt(encoder, tiny_tokenizer):
    with LLM(str(encoder), max_num_batched_tokens=16, **ENGINE) as llm:  # prompts longer than 16 run whole
        batch = llm.embed(PROMPTS, use_tqdm=False)
        alone = [llm.embed(prompt, use_tqdm=False)[0] for prompt in PROMPTS]
    assert len(batch) == len(alone) == len(PROMPTS)
    assert max(len(o.prompt_token_ids) for o in batch) > 16
    for prompt, output, single in zip(PROMPTS, batch, alone, strict=True):
        expected = F.normalize(hf_hidden(encoder, tiny_tokenizer, prompt)[0], dim=-1)
        torch.testing.assert_close(torch.tensor(output.outputs.embedding), expected, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(torch.tensor(single.outputs.embedding), torch.tensor(output.outputs.embedding),
                                   atol=1e-6, rtol=0)


def test_an_encoder_pools_as_its_sentence_transformers_files_say(encoder, tiny_tokenizer, tmp_path):
    model = with_sentence_transformers_files(encoder, tmp_path / "st", "MEAN", normalize=False)
    with LLM(str(model), **ENGINE) as llm:
        outputs = llm.embed(PROMPTS, use_tqdm=False)
    assert len(outputs) == len(PROMPTS)
    for prompt, output in zip(PROMPTS, outputs, strict=True):  # no Normalize module: not normalized
        expected = hf_hidden(encoder, tiny_tokenizer, prompt).mean(dim=0)
        torch.testing.assert_close(torch.tensor(output.outputs.embedding), expected, atol=1e-5, rtol=1e-4)
