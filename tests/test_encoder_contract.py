"""Contract tests: the encoder family (BERT, XLM-RoBERTa) as pooling models, a real worker
process on tiny random checkpoints built by transformers, against its hidden states in float32:
CLS pooling by default, mean pooling from sentence-transformers' files, bidirectional
attention (each prompt runs whole, also past a small token budget), and a batch of mixed
lengths equal to one prompt at a time."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModel

from tests.test_pooling_contract import PROMPTS
from tests.tiny_models import ENCODERS, build_tiny_encoder
from triode import LLM

ENGINE = dict(max_model_len=128, kv_cache_memory="4MiB", dtype="float32")


@pytest.fixture(scope="module", params=sorted(ENCODERS))
def encoder(request, tiny_tokenizer, tmp_path_factory):
    return build_tiny_encoder(tmp_path_factory.mktemp(request.param), request.param, tiny_tokenizer)


def hf_states(path, tokenizer, prompt: str) -> torch.Tensor:
    model = AutoModel.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.inference_mode():
        return model(ids).last_hidden_state[0]


def test_an_encoder_embeds_its_cls_token_and_sees_the_whole_prompt(encoder, tiny_tokenizer):
    with LLM(str(encoder), max_num_batched_tokens=16, **ENGINE) as llm:  # prompts longer than 16 run whole
        batch = llm.embed(PROMPTS, use_tqdm=False)
        alone = [llm.embed(prompt, use_tqdm=False)[0] for prompt in PROMPTS]
    assert len(batch) == len(alone) == len(PROMPTS)
    assert max(len(o.prompt_token_ids) for o in batch) > 16
    for prompt, output, single in zip(PROMPTS, batch, alone, strict=True):
        expected = F.normalize(hf_states(encoder, tiny_tokenizer, prompt)[0], dim=-1)
        torch.testing.assert_close(torch.tensor(output.outputs.embedding), expected, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(torch.tensor(single.outputs.embedding), torch.tensor(output.outputs.embedding),
                                   atol=1e-6, rtol=0)


def test_an_encoder_pools_as_its_sentence_transformers_files_say(encoder, tiny_tokenizer, tmp_path):
    model = tmp_path / "st"
    model.mkdir()
    for item in encoder.iterdir():
        (model / item.name).write_bytes(item.read_bytes())
    (model / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    (model / "1_Pooling").mkdir()
    (model / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    with LLM(str(model), **ENGINE) as llm:
        outputs = llm.embed(PROMPTS, use_tqdm=False)
    assert len(outputs) == len(PROMPTS)
    for prompt, output in zip(PROMPTS, outputs, strict=True):  # no Normalize module: not normalized
        expected = hf_states(encoder, tiny_tokenizer, prompt).mean(dim=0)
        torch.testing.assert_close(torch.tensor(output.outputs.embedding), expected, atol=1e-5, rtol=1e-4)
