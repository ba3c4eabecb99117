"""Unit tests: reading a Hugging Face config.json into ModelConfig (engine.model_config), the
rope fields above all: what each rope type reads, the defaults transformers fills in, and the
errors for what triode does not implement."""

from __future__ import annotations

import pytest

from engine.errors import UnsupportedModelError
from engine.model_config import SUPPORTED_ROPE_TYPES, ModelConfig


def llama_config(**fields):
    return {"architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "max_position_embeddings": 4096, **fields}


def test_v4_and_v5_rope_layouts_read_the_same():
    v4 = ModelConfig.from_hf(llama_config(rope_theta=5e5, rope_scaling={"type": "linear", "factor": 2.0}))
    v5 = ModelConfig.from_hf(llama_config(rope_parameters={"rope_type": "linear", "rope_theta": 5e5, "factor": 2.0}))
    assert (v4.rope_theta, v4.rope_scaling) == (v5.rope_theta, v5.rope_scaling) == (5e5, {"rope_type": "linear",
                                                                                         "factor": 2.0})


def test_yarn_defaults_follow_transformers():
    plain = ModelConfig.from_hf(llama_config(rope_scaling={"rope_type": "yarn", "factor": 4.0}))
    assert plain.rope_scaling == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}
    # No factor: the ratio of the two lengths; a config-level original length (Phi-3's) wins.
    derived = ModelConfig.from_hf(llama_config(original_max_position_embeddings=1024, rope_scaling={
        "rope_type": "yarn", "original_max_position_embeddings": 2048}))
    assert derived.rope_scaling["original_max_position_embeddings"] == 1024
    assert derived.rope_scaling["factor"] == 4.0


def test_an_unknown_rope_type_lists_the_supported_ones():
    with pytest.raises(UnsupportedModelError, match="rope type 'su' is not supported; triode supports "
                                                     + ", ".join(SUPPORTED_ROPE_TYPES)):
        ModelConfig.from_hf(llama_config(rope_scaling={"type": "su", "short_factor": [1.0]}))


@pytest.mark.parametrize(("scaling", "message"), [
    ({"rope_type": "yarn", "factor": 4.0, "apply_yarn_scaling": True}, r"'yarn': apply_yarn_scaling=True not supported"),
    ({"rope_type": "linear", "factor": 2.0, "low_freq_factor": 1.0}, r"'linear': low_freq_factor=1\.0 not supported"),
    ({"rope_type": "default", "factor": 2.0}, r"'default': factor=2\.0 not supported \(triode reads no fields\)"),
])
def test_a_rope_field_triode_does_not_read_is_named_with_its_value(scaling, message):
    with pytest.raises(UnsupportedModelError, match=message):
        ModelConfig.from_hf(llama_config(rope_scaling=scaling))


@pytest.mark.parametrize("where", ["top level", "rope parameters"])
def test_partial_rotary_is_refused(where):
    fields = ({"partial_rotary_factor": 0.5, "rope_theta": 1e4} if where == "top level" else
              {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}})
    with pytest.raises(UnsupportedModelError, match=r"partial_rotary_factor=0\.5 is not supported"):
        ModelConfig.from_hf(llama_config(**fields))
    whole = {"partial_rotary_factor": 1.0, "rope_theta": 1e4}
    assert ModelConfig.from_hf(llama_config(**whole)).rope_scaling is None


@pytest.mark.parametrize(("scaling", "positions"), [
    (None, 4096),
    ({"rope_type": "linear", "factor": 2.0}, 8192),
    ({"rope_type": "dynamic", "factor": 4.0}, 16384),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048}, 8192),
    ({"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 1024}, 4096),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 1024}, 4096),
])
def test_the_context_a_rope_scaling_allows_is_derived_as_vllm_does_at_least_max_positions(scaling, positions):
    assert ModelConfig.from_hf(llama_config(rope_scaling=scaling)).max_positions == positions


def test_dynamic_rope_grows_from_max_position_embeddings():
    config = ModelConfig.from_hf(llama_config(rope_scaling={"rope_type": "dynamic", "factor": 2.0}))
    assert config.rope_scaling == {"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 4096}
