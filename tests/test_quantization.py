"""contract: ``--quantization`` quantizes a float safetensors checkpoint once, into the cache,
and the runner keeps the blocks and runs them with the CPU kernels.

The reference is exact: Hugging Face transformers running the same model with each weight
replaced by its blocks dequantized, so the quantized run must give its greedy tokens (vLLM's
top-5 rule where float32 sums in another order part a near-tie). Bad settings (a value we do
not know, a model that is already quantized, a dtype or device the kernels do not serve) are
refused before anything loads.
"""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize

from tests.gguf_models import tiny_quantizable_llama, write_tiny_gguf
from tests.hf_compare import (
    TINY_MODEL_TEXTS,
    assert_close_to_hf,
    greedy_params,
    hf_greedy,
    make_driver,
)
from triode.engine.config import EngineArgs
from triode.engine.errors import InvalidRequestError
from triode.engine.model_files.resolve import resolve_model
from triode.engine.worker.checkpoint import iter_safetensors, quantized_tensors
from triode.kernels.quant_linear import QuantizedWeight, quantized_kernels_available

pytestmark = pytest.mark.skipif(not quantized_kernels_available(), reason="no AVX2 or no C compiler")

MAX_TOKENS = 24
# quantization -> (block type of the layers' projections, of the embedding and LM head)
EXPECTED = {"int8": ("Q8_0", "Q8_0"), "int4": ("Q4_1", "Q8_0")}


@pytest.fixture(scope="module")
def float_model(tmp_path_factory, tiny_tokenizer):
    """A tiny Llama saved as Hugging Face saves it, in bfloat16 (as most hub checkpoints are)."""
    directory = tmp_path_factory.mktemp("float-model")
    model = tiny_quantizable_llama(tiny_tokenizer).to(torch.bfloat16)
    model.save_pretrained(directory, safe_serialization=True)
    tiny_tokenizer.save_pretrained(directory)
    return directory, model


@pytest.fixture(scope="module", params=sorted(EXPECTED))
def quantized(request, float_model, tmp_path_factory):
    """(quantization, the cache entry, the cache dir)."""
    source, _ = float_model
    cache = tmp_path_factory.mktemp(f"cache-{request.param}")
    entry = resolve_model(str(source), cache_dir=str(cache), progress=False, quantization=request.param).path
    return request.param, entry, cache


def test_every_matrix_is_quantized_from_the_float_weights(quantized, float_model):
    quantization, entry, _ = quantized
    _, model = float_model
    layer_kind, edge_kind = EXPECTED[quantization]
    kinds = quantized_tensors(entry)
    assert kinds["model.embed_tokens.weight"] == kinds["lm_head.weight"] == edge_kind
    layer_kinds = {kind for name, kind in kinds.items() if name.startswith("model.layers.")}
    assert len(kinds) == 2 + 2 * 7 and layer_kinds == {layer_kind}
    tensors = dict(iter_safetensors(entry))
    down = tensors["model.layers.1.mlp.down_proj.weight"]
    assert isinstance(down, QuantizedWeight) and down.kind == layer_kind
    original = model.model.layers[1].mlp.down_proj.weight.detach().float().numpy()
    expected = gguf.quants.quantize(original, gguf.GGMLQuantizationType[layer_kind])
    assert np.array_equal(down.data.numpy(), expected)
    assert tensors["model.norm.weight"].dtype == torch.float32
    config = json.loads((entry / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and (entry / "tokenizer.json").is_file()


def test_the_quantized_run_matches_hf_on_the_dequantized_weights(quantized, float_model, tiny_tokenizer,
                                                                 tmp_path):
    _, entry, _ = quantized
    _, model = float_model
    reference_dir = tmp_path / "dequantized"
    reference = tiny_quantizable_llama(tiny_tokenizer)
    reference.load_state_dict({name: value.float() for name, value in model.state_dict().items()})
    state = reference.state_dict()
    for name, weight in iter_safetensors(entry):
        if isinstance(weight, QuantizedWeight):
            blocks = dequantize(weight.data.numpy(), gguf.GGMLQuantizationType[weight.kind])
            state[name].copy_(torch.from_numpy(blocks.reshape(state[name].shape)))
    reference.save_pretrained(reference_dir, safe_serialization=True)
    prompts = [tiny_tokenizer.encode(text) for text in TINY_MODEL_TEXTS]
    expected = hf_greedy(reference_dir, prompts, MAX_TOKENS)
    driver = make_driver(entry)
    assert driver.runner.quantized == quantized_tensors(entry)
    assert_close_to_hf(driver.generate(prompts, greedy_params(MAX_TOKENS)), expected, logprob_atol=2e-3)


def test_the_entry_is_built_once(quantized, float_model, monkeypatch):
    quantization, entry, cache = quantized
    source, _ = float_model

    def must_not_run(*args, **kwargs):
        raise AssertionError("quantized again")

    monkeypatch.setattr("triode.engine.model_files.resolve.quantize_checkpoint", must_not_run)
    again = resolve_model(str(source), cache_dir=str(cache), progress=False, quantization=quantization)
    assert again.path == entry


def test_an_unknown_value_and_unserved_settings_are_refused():
    with pytest.raises(InvalidRequestError, match=r"quantization must be one of int8, int4; got 'fp8'"):
        EngineArgs(quantization="fp8")
    for settings in ({"dtype": "bfloat16"}, {"device": "cuda"}):
        with pytest.raises(InvalidRequestError, match="it needs dtype auto and a CPU device"):
            EngineArgs(quantization="int8", **settings)


def test_already_quantized_models_are_refused(tmp_path, float_model, quantized, tiny_tokenizer):
    _, entry, _ = quantized
    with pytest.raises(InvalidRequestError, match=r"already quantized \(triode's GGUF blocks\)"):
        resolve_model(str(entry), cache_dir=str(tmp_path), progress=False, quantization="int8")
    path = tmp_path / "tiny.Q8_0.gguf"
    write_tiny_gguf(path, tiny_quantizable_llama(tiny_tokenizer), tiny_tokenizer, "Q8_0")
    with pytest.raises(InvalidRequestError, match="the model is a GGUF file, already quantized"):
        resolve_model(str(path), cache_dir=str(tmp_path), progress=False, quantization="int4")
    gptq = tmp_path / "gptq"
    gptq.mkdir()
    source, _ = float_model
    for item in source.iterdir():
        (gptq / item.name).write_bytes(item.read_bytes())
    config = json.loads((gptq / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (gptq / "config.json").write_text(json.dumps(config))
    with pytest.raises(InvalidRequestError, match=r"already quantized \(gptq"):
        resolve_model(str(gptq), cache_dir=str(tmp_path), progress=False, quantization="int8")
    assert not (tmp_path / "models").exists() or not any(
        p.name.startswith("int8-") for p in (tmp_path / "models").iterdir())
