"""Contract tests: pooling models that ship sentence-transformers' files embed as the
sentence-transformers library itself does, on tiny random checkpoints (an encoder pooling its
mean, a decoder its last token, both normalized), in float32, batched and padded there, batched
and chunked here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.test_pooling_contract import PROMPTS
from tests.tiny_models import build_tiny_encoder
from triode import LLM

MODES = {"MEAN": "pooling_mode_mean_tokens", "LAST": "pooling_mode_lasttoken", "CLS": "pooling_mode_cls_token"}


def with_sentence_transformers_files(source: Path, target: Path, pooling: str) -> Path:
    """``source``'s checkpoint with a Transformer, a Pooling and a Normalize module."""
    target.mkdir()
    for item in source.iterdir():
        if item.is_file():
            (target / item.name).write_bytes(item.read_bytes())
    hidden = json.loads((source / "config.json").read_text())["hidden_size"]
    (target / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    (target / "1_Pooling").mkdir()
    (target / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": hidden, **{key: mode == pooling for mode, key in MODES.items()}}))
    (target / "2_Normalize").mkdir()
    return target


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
