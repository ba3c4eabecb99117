"""Contract tests: pooling models that ship sentence-transformers' files embed as the
sentence-transformers library itself does, on tiny random checkpoints (an encoder pooling its
mean, a decoder its last token, both normalized), in float32, batched and padded there, batched
and chunked here."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.test_pooling_contract import PROMPTS
from tests.tiny_models import build_tiny_encoder, with_sentence_transformers_files
from triode import LLM


@pytest.fixture(scope="module")
def bert(tiny_tokenizer, tmp_path_factory) -> Path:
    return build_tiny_encoder(tmp_path_factory.mktemp("bert"), "bert", tiny_tokenizer)


@pytest.mark.parametrize("family, pooling", [("bert", "MEAN"), ("bert", "CLS"), ("qwen3", "LAST")])
def test_embeddings_equal_sentence_transformers(family, pooling, bert, tiny_model_factory, tmp_path):
    from sentence_transformers import SentenceTransformer

    source = bert if family == "bert" else tiny_model_factory("qwen3")
    model = with_sentence_transformers_files(source, tmp_path / "st", pooling)
    reference = SentenceTransformer(str(model), device="cpu").encode(PROMPTS, convert_to_tensor=True,
                                                                      batch_size=len(PROMPTS))
    with LLM(str(model), runner="pooling", max_model_len=128, kv_cache_memory="4MiB", dtype="float32",
             max_num_batched_tokens=24) as llm:
        outputs = llm.embed(PROMPTS, use_tqdm=False)
    assert len(outputs) == len(PROMPTS) == reference.shape[0]
    for output, expected in zip(outputs, reference, strict=True):
        torch.testing.assert_close(torch.tensor(output.outputs.embedding), expected.float(), atol=1e-5, rtol=1e-4)
