"""How transformers reads the fields of a config.json that ModelConfig holds, per architecture:
its defaults, which layers slide, the rope (per layer type for Gemma 3), Phi-3's partial rotary,
the mixture-of-experts fields; and the errors for a field triode does not implement, naming it
and its value. triode.engine.model.config builds the ModelConfig from these."""

from __future__ import annotations

import math
from typing import Any

from triode.engine.errors import ModelLoadError, UnsupportedModelError

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "Gemma3ForConditionalGeneration",
    "Phi3ForCausalLM",
    "MixtralForCausalLM",
    "Qwen3MoeForCausalLM",
)
GEMMA = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
# What transformers' config classes default to where a Gemma config.json is silent.
DEFAULTS: dict[str, dict[str, Any]] = {
    "Gemma2ForCausalLM": {
        "vocab_size": 256000, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
        "num_attention_heads": 8, "num_key_value_heads": 4, "rms_norm_eps": 1e-6, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 8192,
        "tie_word_embeddings": True, "query_pre_attn_scalar": 256, "sliding_window": 4096,
        "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0,
    },
    "Gemma3ForCausalLM": {
        "vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
        "num_attention_heads": 8, "num_key_value_heads": 4, "rms_norm_eps": 1e-6, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 131072,
        "tie_word_embeddings": True, "query_pre_attn_scalar": 256, "sliding_window": 4096,
        "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0, "sliding_window_pattern": 6,
    },
}
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
# The fields each rope type reads (engine/worker/models/rope.py); any other fails at load.
ROPE_FIELDS = {
    "default": frozenset(),
    "linear": frozenset({"factor"}),
    "llama3": frozenset({"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}),
    "dynamic": frozenset({"factor"}),
    "yarn": frozenset({"factor", "attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
                       "original_max_position_embeddings", "truncate"}),
    "longrope": frozenset({"short_factor", "long_factor", "factor", "attention_factor",
                           "original_max_position_embeddings"}),
}
SUPPORTED_ROPE_TYPES = tuple(ROPE_FIELDS)
LAYER_TYPES = ("full_attention", "sliding_attention")
_QWEN = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")


# The sizes every config.json gives (or its architecture defaults to); those it may leave out
# (a default stands for them); those it may also set to null (another field stands for them);
# the counts a dense model may give as 0 (its experts); and bounds far above any model's: a
# corrupt count built tables of its size (a billion layers ran the loader out of memory).
_REQUIRED_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
_OPTIONAL_SIZES = ("num_key_value_heads", "head_dim", "max_position_embeddings", "num_experts_per_tok",
                   "moe_intermediate_size", "num_local_experts", "num_experts")
_NULLABLE_SIZES = ("num_key_value_heads", "head_dim", "num_local_experts", "num_experts")
_EXPERT_COUNTS = ("num_local_experts", "num_experts", "num_experts_per_tok", "moe_intermediate_size")
_BOUNDS = {"num_hidden_layers": 10_000, "num_local_experts": 100_000, "num_experts": 100_000,
           "vocab_size": 2**31 - 1}  # token ids are int32


def check_sizes(raw: dict[str, Any], source: str, *, epsilon: str = "rms_norm_eps") -> None:
    """Refuses a size that is missing, not an integer in range or past any model's, and a norm
    ``epsilon`` that is not a positive number, naming the field (``ModelLoadError``): such
    values failed later as a KeyError or TypeError in a worker, or in a kernel at the first
    step, which ended the engine."""
    for name in (*_REQUIRED_SIZES, *_OPTIONAL_SIZES):
        value = raw.get(name)
        if name not in raw and name in _REQUIRED_SIZES:
            raise ModelLoadError(f"{name} is missing", path=source)
        if name not in raw or (value is None and name in _NULLABLE_SIZES):
            continue
        if value is None:
            raise ModelLoadError(f"{name} is null", path=source)
        least = 0 if name in _EXPERT_COUNTS else 1
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            kind = "a non-negative" if least == 0 else "a positive"
            raise ModelLoadError(f"{name} must be {kind} integer, got {value!r}", path=source)
        if value > _BOUNDS.get(name, value):
            raise ModelLoadError(f"{name}={value} is past any model's (at most {_BOUNDS[name]})", path=source)
    if epsilon in raw:
        _finite(raw[epsilon], epsilon, source, positive=True)


def experts(raw: dict[str, Any], architecture: str, source: str) -> dict[str, Any]:
    """The mixture-of-experts fields as transformers reads them: Mixtral routes every layer
    over num_local_experts experts of intermediate_size features and renormalises; Qwen3-MoE's
    layers are sparse every decoder_sparse_step-th layer but those in mlp_only_layers, with
    moe_intermediate_size features, renormalised only with norm_topk_prob."""
    if architecture not in ("MixtralForCausalLM", "Qwen3MoeForCausalLM"):
        return {}
    layers = raw["num_hidden_layers"]
    # each model's name first; transformers v5 writes Qwen3-MoE's as num_local_experts too
    names = ("num_local_experts", "num_experts")
    if architecture == "Qwen3MoeForCausalLM":
        names = names[::-1]
    experts = next((raw[name] for name in names if raw.get(name) is not None), 8)
    top_k = raw.get("num_experts_per_tok", 2)
    if not 1 <= top_k <= experts:
        raise UnsupportedModelError(f"num_experts_per_tok={top_k!r} must lie in 1..{experts} experts", path=source)
    if architecture == "MixtralForCausalLM":
        return {"num_experts": experts, "num_experts_per_tok": top_k, "norm_topk_prob": True,
                "moe_intermediate_size": raw["intermediate_size"], "moe_layers": (True,) * layers}
    step, dense = raw.get("decoder_sparse_step", 1), set(raw.get("mlp_only_layers") or ())
    return {"num_experts": experts, "num_experts_per_tok": top_k,
            "norm_topk_prob": bool(raw.get("norm_topk_prob", False)),
            "moe_intermediate_size": raw.get("moe_intermediate_size", 768),
            "moe_layers": tuple(i not in dense and experts > 0 and (i + 1) % step == 0 for i in range(layers))}


def attention_layers(raw: dict[str, Any], architecture: str, source: str) -> tuple[int | None, tuple[str, ...]]:
    """(sliding window, each layer's attention type) as transformers reads them: Mistral
    windows every layer; Qwen2/3 only with use_sliding_window, the layers from
    max_window_layers on unless layer_types says otherwise; Llama has no window."""
    num_layers = raw["num_hidden_layers"]
    window = raw.get("sliding_window")
    if architecture == "LlamaForCausalLM" or (architecture in _QWEN and not raw.get("use_sliding_window")):
        window = None
    if window is None:
        return None, ("full_attention",) * num_layers
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise UnsupportedModelError(f"sliding_window={window!r} is not a positive number of tokens", path=source)
    types = raw.get("layer_types") if architecture in _QWEN + GEMMA else None
    if types is None and architecture in _QWEN:
        first = raw.get("max_window_layers", 28)
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    if types is None and architecture in GEMMA:
        # every other layer (Gemma 2), or five of every six (Gemma 3), the last of each group global
        pattern = 2 if architecture == "Gemma2ForCausalLM" else raw["sliding_window_pattern"]
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
    if types is None:
        types = ["sliding_attention"] * num_layers
    if len(types) != num_layers or not set(types) <= set(LAYER_TYPES):
        raise UnsupportedModelError(f"layer_types={types!r}: expected {num_layers} of "
                                    f"{', '.join(LAYER_TYPES)}", path=source)
    return window, tuple(types)


def ropes(raw: dict[str, Any], architecture: str, source: str) -> tuple[float, dict[str, Any] | None, float | None]:
    """(theta, scaling) of the rope, and the base of the sliding layers' own default rope
    (Gemma 3; None elsewhere). Gemma 3 in transformers v5 keeps one rope per layer type in
    ``rope_parameters``; v4 has ``rope_local_base_freq``, its scaling applying to the global
    layers only."""
    if architecture == "Phi3ForCausalLM":
        # transformers' Phi-3 reads its older names for longrope ("su", and "yarn") as longrope
        scaling = dict(raw.get("rope_scaling") or {})
        kind = scaling.get("rope_type") or scaling.get("type")
        if kind in ("su", "yarn"):
            scaling.pop("type", None)
            raw = {**raw, "rope_scaling": {**scaling, "rope_type": "longrope"}}
    if architecture != "Gemma3ForCausalLM":
        theta, scaling = _rope(raw, source)
        if scaling is not None and scaling["rope_type"] == "longrope":
            _check_longrope(scaling, raw, source)
        return theta, scaling, None
    params = raw.get("rope_parameters") or {}
    if "full_attention" in params:
        local = dict(params.get("sliding_attention") or {"rope_type": "default"})
        theta, scaling = _rope({**raw, "rope_parameters": params["full_attention"]}, source)
        local_theta, local_scaling = _rope({**raw, "rope_parameters": None, "rope_scaling": local,
                                            "rope_theta": local.pop("rope_theta", 10_000.0)}, source)
        if local_scaling is not None:
            raise UnsupportedModelError(f"rope_parameters.sliding_attention={params['sliding_attention']!r}: "
                                        "the sliding layers' rope must be a default one", path=source)
        return theta, scaling, local_theta
    theta, scaling = _rope(raw, source)
    return theta, scaling, float(raw["rope_local_base_freq"])


def _rope(raw: dict[str, Any], source: str) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling) from either transformers v5's ``rope_parameters`` or v4's
    ``rope_theta`` + ``rope_scaling``."""
    params = raw.get("rope_parameters")
    for field in ("rope_parameters", "rope_scaling"):
        if not isinstance(raw.get(field) or {}, dict):
            raise ModelLoadError(f"{field} must be an object, got {raw[field]!r}", path=source)
    if params and "rope_theta" in params:
        theta = _finite(params["rope_theta"], "rope_parameters.rope_theta", source, positive=True)
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = _finite(raw.get("rope_theta", 10000.0), "rope_theta", source, positive=True)
        scaling = dict(raw.get("rope_scaling") or {})
    rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    scaling.pop("type", None)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"rope type {rope_type!r} is not supported; triode supports {', '.join(SUPPORTED_ROPE_TYPES)}",
            path=source,
        )
    partial = scaling.pop("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if partial is not None and float(partial) != 1.0 and raw.get("architectures") != ["Phi3ForCausalLM"]:
        raise UnsupportedModelError(f"partial_rotary_factor={partial!r} is not supported (rotary over "
                                    "the whole head but for Phi-3)", path=source)
    if unknown := sorted(set(scaling) - ROPE_FIELDS[rope_type]):
        fields = ", ".join(f"{name}={scaling[name]!r}" for name in unknown)
        raise UnsupportedModelError(f"rope type {rope_type!r}: {fields} not supported (triode reads "
                                    f"{', '.join(sorted(ROPE_FIELDS[rope_type])) or 'no fields'})",
                                    path=source)
    for field, value in scaling.items():
        if field not in ("short_factor", "long_factor", "truncate") and value is not None:
            _finite(value, f"rope {field}", source)
    if rope_type == "dynamic":
        # Dynamic NTK grows the base once a sequence passes the pretraining length, which
        # transformers takes from max_position_embeddings.
        scaling["original_max_position_embeddings"] = raw.get("max_position_embeddings", 2048)
    if rope_type in ("yarn", "longrope"):
        # As transformers does: a config-level original length (Phi-3's place) wins, then the
        # rope's own, then max_position_embeddings; without a factor, their ratio.
        original = raw.get("original_max_position_embeddings") or scaling.get("original_max_position_embeddings")
        scaling["original_max_position_embeddings"] = original or raw.get("max_position_embeddings", 2048)
        if scaling.get("factor") is None:
            scaling["factor"] = raw.get("max_position_embeddings", 2048) / scaling["original_max_position_embeddings"]
    return theta, None if rope_type == "default" else {"rope_type": rope_type, **scaling}


def _finite(value: object, name: str, source: str, *, positive: bool = False) -> float:
    """``value`` as a float where it is a finite number (and positive, where asked); a string or
    null once failed as a bare ValueError or TypeError in the worker."""
    if (not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value)
            or (positive and value <= 0)):
        raise ModelLoadError(f"{name} must be a {'positive' if positive else 'finite'} number, got {value!r}",
                             path=source)
    return float(value)


def rotary_dim(raw: dict[str, Any], architecture: str, source: str) -> int | None:
    """Phi-3's rotated share of each head (transformers rotates the first int(head_dim *
    partial_rotary_factor) dimensions, the rest pass), or None: the whole head."""
    if architecture != "Phi3ForCausalLM":
        return None
    partial = (raw.get("rope_parameters") or {}).get("partial_rotary_factor") or raw.get("partial_rotary_factor") or 1.0
    head_dim = raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]
    dim = int(head_dim * float(partial))
    if not 0 < dim <= head_dim or dim % 2:
        raise UnsupportedModelError(f"partial_rotary_factor={partial!r}: rotates {dim} of {head_dim} dimensions "
                                    "(an even number from 2 to the head size is needed)", path=source)
    return None if dim == head_dim else dim


def _check_longrope(scaling: dict[str, Any], raw: dict[str, Any], source: str) -> None:
    head_dim = rotary_dim(raw, "Phi3ForCausalLM", source) or raw.get("head_dim") or (
        raw["hidden_size"] // raw["num_attention_heads"])
    for name in ("short_factor", "long_factor"):
        factors = scaling.get(name)
        if not isinstance(factors, list) or len(factors) != head_dim // 2:
            raise UnsupportedModelError(f"rope type 'longrope': {name} must list {head_dim // 2} factors "
                                        f"(one per frequency), got {factors!r}", path=source)
