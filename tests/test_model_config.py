"""Unit tests: reading a Hugging Face config.json into ModelConfig (triode.engine.model.config), the
rope fields above all: what each rope type reads, the defaults transformers fills in, and the
errors for what triode does not implement; sizes, norms and rope fields that are missing, of the
wrong type or past any model's, named before anything is built from them."""

from __future__ import annotations

import re

import pytest

from triode.engine.errors import ModelLoadError, UnsupportedModelError
from triode.engine.model.config import SUPPORTED_ROPE_TYPES, ModelConfig


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
def test_partial_rotary_is_phi3s_only(where):
    fields = ({"partial_rotary_factor": 0.5, "rope_theta": 1e4} if where == "top level" else
              {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}})
    with pytest.raises(UnsupportedModelError, match=r"partial_rotary_factor=0\.5 is not supported"):
        ModelConfig.from_hf(llama_config(**fields))  # transformers' Llama cannot run it either
    whole = {"partial_rotary_factor": 1.0, "rope_theta": 1e4}
    assert ModelConfig.from_hf(llama_config(**whole)).rope_scaling is None
    phi3 = ModelConfig.from_hf(llama_config(architectures=["Phi3ForCausalLM"], **fields))
    assert (phi3.rotary_dim, phi3.rope_dim, phi3.head_dim) == (8, 8, 16)
    with pytest.raises(UnsupportedModelError, match=r"partial_rotary_factor=0\.1: rotates 1 of 16"):
        ModelConfig.from_hf(llama_config(architectures=["Phi3ForCausalLM"], partial_rotary_factor=0.1))


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


def gemma3_config(**fields):
    return {"architectures": ["Gemma3ForCausalLM"], "vocab_size": 100, "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 7, "num_attention_heads": 4,
            "num_key_value_heads": 1, **fields}


def test_gemma3_v4_and_v5_ropes_read_the_same_and_keep_the_scaled_length():
    v4 = ModelConfig.from_hf(gemma3_config(rope_theta=1e6, rope_local_base_freq=1e4,
                                           rope_scaling={"rope_type": "linear", "factor": 8.0}))
    v5 = ModelConfig.from_hf(gemma3_config(rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}))
    for config in (v4, v5):
        assert (config.rope_theta, config.rope_scaling, config.local_rope_theta) == (
            1e6, {"rope_type": "linear", "factor": 8.0}, 1e4)
        # transformers' defaults: five sliding layers of every six, 4096-token windows, (1 + w)
        # norms, q/k norms, the scale from query_pre_attn_scalar, no soft caps, tied embeddings
        assert config.layer_types == ("sliding_attention",) * 5 + ("full_attention", "sliding_attention")
        assert config.sliding_window == 4096 and config.kv_window is None
        assert config.gemma_norms and config.qk_norm and config.tie_word_embeddings
        assert config.attention_scale == 256**-0.5 and config.head_dim == 256
        assert config.hidden_act == "gelu_pytorch_tanh" and config.embedding_multiplier == 8.0
        assert config.attn_logit_softcapping is None and config.final_logit_softcapping is None
        assert config.max_positions == 131072  # already the scaled length, as vLLM reads it


def test_gemma2_defaults_follow_transformers():
    config = ModelConfig.from_hf({**gemma3_config(num_hidden_layers=4), "architectures": ["Gemma2ForCausalLM"]})
    assert config.layer_types == ("sliding_attention", "full_attention") * 2
    assert (config.attn_logit_softcapping, config.final_logit_softcapping) == (50.0, 30.0)
    assert config.local_rope_theta is None and not config.qk_norm and config.tie_word_embeddings
    assert config.layer_window(0) == 4096 and config.layer_window(1) is None


@pytest.mark.parametrize(("fields", "message"), [
    ({"hidden_activation": "relu"}, "hidden_act='relu' is not supported"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention=True is not supported"),
    ({"layer_types": ["sliding_attention"] * 6}, "layer_types=.* expected 7 of full_attention, sliding_attention"),
    ({"sliding_window": 0}, "sliding_window=0 is not a positive number"),
    ({"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                          "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}},
     "the sliding layers' rope must be a default one"),
])
def test_what_gemma_configs_ask_beyond_triode_is_named(fields, message):
    with pytest.raises(UnsupportedModelError, match=message):
        ModelConfig.from_hf(gemma3_config(**fields))


def test_which_layers_slide():
    # Mistral windows every layer; Qwen2 the layers from max_window_layers on, only with
    # use_sliding_window; Llama never.
    mistral = ModelConfig.from_hf(llama_config(architectures=["MistralForCausalLM"], sliding_window=32))
    assert mistral.layer_types == ("sliding_attention",) * 2 and mistral.kv_window == 32
    qwen = ModelConfig.from_hf(llama_config(architectures=["Qwen2ForCausalLM"], sliding_window=32,
                                            use_sliding_window=True, max_window_layers=1))
    assert qwen.layer_types == ("full_attention", "sliding_attention") and qwen.kv_window is None
    assert ModelConfig.from_hf(llama_config(architectures=["Qwen2ForCausalLM"], sliding_window=32)).sliding_window is None
    assert ModelConfig.from_hf(llama_config(sliding_window=32)).layer_window(0) is None


def phi3_config(**fields):
    return {**llama_config(architectures=["Phi3ForCausalLM"], max_position_embeddings=131072,
                           original_max_position_embeddings=4096), **fields}


@pytest.mark.parametrize("name", ["longrope", "su", "yarn"])
def test_phi3_reads_longrope_and_its_older_names(name):
    config = ModelConfig.from_hf(phi3_config(rope_scaling={"type": name, "short_factor": [1.0] * 8,
                                                           "long_factor": [2.0] * 8}))
    assert config.rope_scaling == {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
                                   "original_max_position_embeddings": 4096, "factor": 32.0}
    assert config.max_positions == 131072  # the long length already, not stretched again


def test_longrope_factors_must_cover_every_frequency():
    with pytest.raises(UnsupportedModelError, match=r"short_factor must list 8 factors \(one per frequency\)"):
        ModelConfig.from_hf(phi3_config(rope_scaling={"type": "longrope", "short_factor": [1.0] * 7,
                                                      "long_factor": [2.0] * 8}))


def test_mixture_of_experts_fields_follow_transformers():
    mixtral = ModelConfig.from_hf(llama_config(architectures=["MixtralForCausalLM"], num_local_experts=8,
                                               num_experts_per_tok=2))
    assert (mixtral.num_experts, mixtral.num_experts_per_tok, mixtral.moe_intermediate_size) == (8, 2, 128)
    assert mixtral.norm_topk_prob and mixtral.moe_layers == (True, True)
    # Qwen3-MoE: sparse every decoder_sparse_step-th layer but mlp_only_layers; no
    # renormalisation unless norm_topk_prob
    qwen = ModelConfig.from_hf(llama_config(architectures=["Qwen3MoeForCausalLM"], num_hidden_layers=4,
                                            num_experts=16, num_experts_per_tok=4, moe_intermediate_size=32,
                                            decoder_sparse_step=2, mlp_only_layers=[3]))
    assert qwen.moe_layers == (False, True, False, False) and not qwen.norm_topk_prob and qwen.qk_norm
    assert [qwen.layer_is_moe(i) for i in range(4)] == [False, True, False, False]
    with pytest.raises(UnsupportedModelError, match=r"num_experts_per_tok=9 must lie in 1\.\.8 experts"):
        ModelConfig.from_hf(llama_config(architectures=["MixtralForCausalLM"], num_local_experts=8,
                                         num_experts_per_tok=9))


def test_a_gemma3_multimodal_config_is_read_as_its_text_model():
    text = {k: v for k, v in gemma3_config().items() if k != "architectures"}
    config = ModelConfig.from_hf({"architectures": ["Gemma3ForConditionalGeneration"], "text_config": text,
                                  "vision_config": {"hidden_size": 32}, "tie_word_embeddings": True})
    assert config.architecture == "Gemma3ForCausalLM" and config.weights_prefix == "language_model."
    assert config.num_layers == 7 and config.local_rope_theta == 10_000.0 and config.tie_word_embeddings


@pytest.mark.parametrize("fields, message", [
    ({"hidden_size": None}, "hidden_size is null"),
    ({"hidden_size": "64"}, "hidden_size must be a positive integer, got '64'"),
    ({"num_hidden_layers": 2.5}, "num_hidden_layers must be a positive integer, got 2.5"),
    ({"num_hidden_layers": 10**9}, "num_hidden_layers=1000000000 is past any model's"),
    ({"vocab_size": -1}, "vocab_size must be a positive integer, got -1"),
    ({"vocab_size": 10**12}, "vocab_size=1000000000000 is past any model's"),
    ({"intermediate_size": True}, "intermediate_size must be a positive integer, got True"),
    ({"max_position_embeddings": "big"}, "max_position_embeddings must be a positive integer"),
    ({"max_position_embeddings": None}, "max_position_embeddings is null"),
    ({"num_experts": -8}, "num_experts must be a non-negative integer, got -8"),
    ({"rms_norm_eps": None}, "rms_norm_eps must be a positive number, got None"),
    ({"rms_norm_eps": float("nan")}, "rms_norm_eps must be a positive number, got nan"),
    ({"architectures": "LlamaForCausalLM"}, "architectures must be a list of class names"),
    ({"rope_theta": "x"}, "rope_theta must be a positive number, got 'x'"),
    ({"rope_theta": None}, "rope_theta must be a positive number, got None"),
    ({"rope_scaling": "yarn"}, "rope_scaling must be an object, got 'yarn'"),
    ({"rope_scaling": {"rope_type": "linear", "factor": "2"}}, "rope factor must be a finite number, got '2'"),
])
def test_sizes_and_norms_are_checked_naming_the_field(fields, message):
    """Found by probing: each failed later, as a KeyError or TypeError in the worker or in a
    kernel at the first step (rms_norm_eps null: /health said ready, the first request ended
    the engine)."""
    with pytest.raises(ModelLoadError, match=f"config.json: {re.escape(message)}"):
        ModelConfig.from_hf(llama_config(**fields))


def test_a_missing_size_and_missing_architectures_are_named():
    config = llama_config()
    del config["hidden_size"]
    with pytest.raises(ModelLoadError, match=r"config\.json: hidden_size is missing"):
        ModelConfig.from_hf(config)
    with pytest.raises(UnsupportedModelError, match=r"no architectures are named \(model_type 'llama'\)"):
        ModelConfig.from_hf({**llama_config(), "architectures": None, "model_type": "llama"})
    # null where transformers reads null as "derive it": the heads' count, the head size
    derived = ModelConfig.from_hf(llama_config(num_key_value_heads=None, head_dim=None, num_experts=0))
    assert (derived.num_kv_heads, derived.head_dim) == (4, 16)
