"""Unit tests: which runner a checkpoint gets and how a pooling model pools (vLLM's rules and
sentence-transformers' files), and how a pooling prompt is truncated (keeping the special
tokens an encoder's tokenizer puts around it)."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from triode.engine.errors import InvalidRequestError, UnsupportedModelError
from triode.engine.inputs import InputProcessor
from triode.engine.model.pooling import (
    PoolerConfig,
    pooler_config,
    read_pooler_config,
    resolve_runner,
)
from triode.engine.pooling_params import PoolingParams


@pytest.mark.parametrize("architectures, runner, convert, expected", [
    (["LlamaForCausalLM"], "auto", "auto", "generate"),
    (["LlamaForCausalLM"], "pooling", "auto", "pooling"),
    (["LlamaForCausalLM"], "auto", "embed", "pooling"),
    (["Qwen3Model"], "auto", "auto", "pooling"),
    (["BertModel"], "auto", "none", "pooling"),
])
def test_runners(architectures, runner, convert, expected):
    assert resolve_runner(architectures, runner=runner, convert=convert) == expected


def test_runners_refused():
    with pytest.raises(UnsupportedModelError, match="no language-model head"):
        resolve_runner(["XLMRobertaModel"], runner="generate")
    with pytest.raises(UnsupportedModelError, match="--convert embed"):
        resolve_runner(["Qwen3ForCausalLM"], runner="pooling", convert="none")


def modules(path, *kinds: str, pooling: dict | None = None):
    path.joinpath("modules.json").write_text(json.dumps([
        {"idx": i, "name": str(i), "path": f"{i}_{kind}", "type": f"sentence_transformers.models.{kind}"}
        for i, kind in enumerate(kinds)]))
    if pooling is not None:
        index = kinds.index("Pooling")
        path.joinpath(f"{index}_Pooling").mkdir()
        path.joinpath(f"{index}_Pooling", "config.json").write_text(json.dumps(pooling))
    return path


def test_pooling_from_the_files_or_the_defaults(tmp_path):
    assert read_pooler_config(tmp_path, None) == PoolerConfig(pooling_type="LAST", normalize=True)
    assert read_pooler_config(tmp_path, None, encoder=True) == PoolerConfig(pooling_type="CLS", normalize=True)
    given = pooler_config('{"pooling_type": "mean", "normalize": false}')
    assert read_pooler_config(tmp_path, given) == PoolerConfig(pooling_type="MEAN", normalize=False)
    modules(tmp_path, "Transformer", "Pooling", "Normalize", pooling={"pooling_mode_lasttoken": True})
    assert read_pooler_config(tmp_path, None) == PoolerConfig(pooling_type="LAST", normalize=True)


@pytest.mark.parametrize("kinds, pooling, says", [
    (("Transformer", "Pooling", "Dense", "Normalize"), {"pooling_mode_cls_token": True}, "Dense"),
    (("Transformer", "Pooling"), {"pooling_mode_max_tokens": True}, "pooling"),
    (("Transformer", "Pooling"), {"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": True}, "pooling"),
    (("Transformer", "Pooling"), {"pooling_mode_mean_tokens": True, "include_prompt": False}, "pooling"),
])
def test_pooling_that_would_not_match_the_library_is_refused(tmp_path, kinds, pooling, says):
    with pytest.raises(UnsupportedModelError, match=says):
        read_pooler_config(modules(tmp_path, *kinds, pooling=pooling), None)


def test_bad_pooler_configs():
    for value in ('{"pooling_type": "MAX"}', "{not json", '{"pooling": "MEAN"}', '{"pooling_type": 3}',
                  '{"normalize": "yes"}', "[1]"):
        with pytest.raises(InvalidRequestError):
            pooler_config(value)


def test_truncation_keeps_an_encoders_special_tokens():
    vocab = {"[PAD]": 0, "[UNK]": 1, "[CLS]": 2, "[SEP]": 3, "a": 4, "b": 5, "c": 6, "d": 7}
    backend = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]",
                                                           special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")
    processor = InputProcessor(tokenizer, max_model_len=5, vocab_size=8, hidden_size=8)
    text = processor.process("a b c d a b c", PoolingParams(truncate_prompt_tokens=-1))
    assert text.prompt_token_ids == (2, 4, 5, 6, 3)  # [CLS], the last three words, [SEP]
    ids = processor.process([2, 4, 5, 6, 7, 4, 3], PoolingParams(truncate_prompt_tokens=4))
    assert ids.prompt_token_ids == (6, 7, 4, 3)  # token ids are cut as given, as vLLM does
    with pytest.raises(InvalidRequestError) as caught:
        processor.process("a b c d a b c", PoolingParams())
    assert caught.value.field == "prompt"
    with pytest.raises(InvalidRequestError) as too_many:
        processor.process("a", PoolingParams(truncate_prompt_tokens=6))
    assert too_many.value.field == "truncate_prompt_tokens"
