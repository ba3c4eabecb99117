"""The model facts triode needs, read from a Hugging Face config.json (v4 and v5 layouts)."""

from __future__ import annotations

from typing import Any

import attrs

from engine.errors import UnsupportedModelError

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)
# The fields each rope type reads (engine/worker/models/rope.py); any other fails at load.
ROPE_FIELDS = {
    "default": frozenset(),
    "linear": frozenset({"factor"}),
    "llama3": frozenset({"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}),
    "dynamic": frozenset({"factor"}),
    "yarn": frozenset({"factor", "attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
                       "original_max_position_embeddings", "truncate"}),
}
SUPPORTED_ROPE_TYPES = tuple(ROPE_FIELDS)


@attrs.frozen(kw_only=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    sliding_window: int | None

    @property
    def max_positions(self) -> int:
        """The longest context the model's rope is defined for, derived as vLLM derives it (a
        linear, dynamic or yarn scaling stretches its pretraining length by its factor), but
        never below max_position_embeddings."""
        scaling = self.rope_scaling or {}
        stretched = self.max_position_embeddings
        if scaling.get("rope_type") in ("linear", "dynamic"):
            stretched = int(self.max_position_embeddings * scaling["factor"])
        elif scaling.get("rope_type") == "yarn":
            stretched = int(scaling["original_max_position_embeddings"] * scaling["factor"])
        return max(stretched, self.max_position_embeddings)

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V per token over all layers, per byte of element size."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf(cls, raw: dict[str, Any], *, source: str = "config.json") -> ModelConfig:
        architectures = raw.get("architectures") or []
        architecture = next((a for a in architectures if a in SUPPORTED_ARCHITECTURES), None)
        if architecture is None:
            raise UnsupportedModelError(
                f"architecture {architectures or raw.get('model_type')!r} is not supported; "
                f"triode supports {', '.join(SUPPORTED_ARCHITECTURES)}",
                path=source,
            )
        num_heads = raw["num_attention_heads"]
        hidden = raw["hidden_size"]
        theta, scaling = _rope(raw, source)
        is_qwen2 = architecture == "Qwen2ForCausalLM"
        attention_bias = bool(raw.get("attention_bias", False))
        sliding = raw.get("sliding_window")
        if architecture in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and not raw.get("use_sliding_window"):
            sliding = None
        return cls(
            architecture=architecture,
            vocab_size=raw["vocab_size"],
            hidden_size=hidden,
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=raw.get("head_dim") or hidden // num_heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=is_qwen2 or attention_bias,
            o_bias=attention_bias and not is_qwen2,
            mlp_bias=bool(raw.get("mlp_bias", False)),
            qk_norm=architecture == "Qwen3ForCausalLM",
            sliding_window=sliding,
        )


def _rope(raw: dict[str, Any], source: str) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling) from either transformers v5's ``rope_parameters`` or v4's
    ``rope_theta`` + ``rope_scaling``."""
    params = raw.get("rope_parameters")
    if params and "rope_theta" in params:
        theta = float(params["rope_theta"])
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = float(raw.get("rope_theta", 10000.0))
        scaling = dict(raw.get("rope_scaling") or {})
    rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    scaling.pop("type", None)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"rope type {rope_type!r} is not supported; triode supports {', '.join(SUPPORTED_ROPE_TYPES)}",
            path=source,
        )
    partial = scaling.pop("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if partial is not None and float(partial) != 1.0:
        raise UnsupportedModelError(f"partial_rotary_factor={partial!r} is not supported (rotary over "
                                    "the whole head only)", path=source)
    if unknown := sorted(set(scaling) - ROPE_FIELDS[rope_type]):
        fields = ", ".join(f"{name}={scaling[name]!r}" for name in unknown)
        raise UnsupportedModelError(f"rope type {rope_type!r}: {fields} not supported (triode reads "
                                    f"{', '.join(sorted(ROPE_FIELDS[rope_type])) or 'no fields'})",
                                    path=source)
    if rope_type == "dynamic":
        # Dynamic NTK grows the base once a sequence passes the pretraining length, which
        # transformers takes from max_position_embeddings.
        scaling["original_max_position_embeddings"] = raw.get("max_position_embeddings", 2048)
    if rope_type == "yarn":
        # As transformers does: a config-level original length (Phi-3's place) wins, then the
        # rope's own, then max_position_embeddings; without a factor, their ratio.
        original = raw.get("original_max_position_embeddings") or scaling.get("original_max_position_embeddings")
        scaling["original_max_position_embeddings"] = original or raw.get("max_position_embeddings", 2048)
        if scaling.get("factor") is None:
            scaling["factor"] = raw.get("max_position_embeddings", 2048) / scaling["original_max_position_embeddings"]
    return theta, None if rope_type == "default" else {"rope_type": rope_type, **scaling}
