"""The model facts triode needs, read from a Hugging Face config.json (v4 and v5 layouts)."""

from __future__ import annotations

from typing import Any

import attrs

from triode.engine.errors import ModelLoadError, UnsupportedModelError
from triode.engine.model.hf_fields import (
    ACTIVATIONS,
    DEFAULTS,
    GEMMA,
    LAYER_TYPES,
    ROPE_FIELDS,
    SUPPORTED_ARCHITECTURES,
    SUPPORTED_ROPE_TYPES,
    attention_layers,
    check_sizes,
    experts,
    ropes,
    rotary_dim,
)
from triode.engine.model.pooling import BASE_MODELS, ENCODERS

__all__ = ["ACTIVATIONS", "GEMMA", "LAYER_TYPES", "ROPE_FIELDS", "SUPPORTED_ARCHITECTURES", "SUPPORTED_ROPE_TYPES",
           "ModelConfig"]


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
    # per layer, one of LAYER_TYPES: a "sliding_attention" layer sees the last sliding_window keys
    layer_types: tuple[str, ...] = attrs.field(converter=tuple, default=())
    hidden_act: str = "silu"  # the MLP's gate activation, one of ACTIVATIONS
    # Gemma: norms scale by (1 + weight); pre- and post-feedforward norms around the MLP (and
    # the attention output normed before the residual); embeddings scaled by sqrt(hidden)
    gemma_norms: bool = False
    embedding_multiplier: float | None = None
    query_pre_attn_scalar: float | None = None  # attention scale: its -0.5 power (else head_dim's)
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    # the rope of the sliding layers where it differs from the others' (Gemma 3's local base)
    local_rope_theta: float | None = None
    # mixture of experts: each token's num_experts_per_tok of num_experts experts of
    # moe_intermediate_size features, renormalised when norm_topk_prob, in the layers moe_layers marks
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    moe_layers: tuple[bool, ...] = attrs.field(converter=tuple, default=())

    def layer_is_moe(self, layer: int) -> bool:
        return bool(self.moe_layers) and self.moe_layers[layer]

    # where the text model's tensors sit in a multimodal checkpoint (Gemma 3's
    # "language_model."); tensors outside it (the vision tower) are not read into the model
    weights_prefix: str = ""

    # the leading dimensions of each head that rotate (Phi-4-mini's partial_rotary_factor)
    rotary_dim: int | None = None
    # a bare decoder checkpoint (Qwen3Model...): no LM head, a pooling model
    base_model: bool = False
    # an encoder (BertModel, XLMRobertaModel): bidirectional attention over a whole prompt,
    # learned absolute positions from position_offset (XLM-R's padding_idx + 1), LayerNorm
    # after each block (rms_norm_eps holds its eps), token type 0 added to every embedding
    encoder: bool = False
    position_offset: int = 0

    @property
    def rope_dim(self) -> int:
        return self.rotary_dim or self.head_dim

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of layer ``layer`` (None: it attends to the whole context)."""
        if self.layer_types and self.layer_types[layer] == "sliding_attention":
            return self.sliding_window
        return None

    @property
    def kv_window(self) -> int | None:
        """The window when every layer has one (Mistral v0.1): KV older than it is never read
        again and its blocks can be freed. None when any layer sees the whole context."""
        if self.layer_types and all(kind == "sliding_attention" for kind in self.layer_types):
            return self.sliding_window
        return None

    @property
    def max_positions(self) -> int:
        if self.encoder:
            return self.max_position_embeddings - self.position_offset
        return self._rope_positions

    @property
    def _rope_positions(self) -> int:
        """The longest context the model's rope is defined for, derived as vLLM derives it (a
        linear, dynamic or yarn scaling stretches its pretraining length by its factor), but
        never below max_position_embeddings."""
        scaling = self.rope_scaling or {}
        stretched = self.max_position_embeddings
        if self.architecture == "Gemma3ForCausalLM":
            pass  # its max_position_embeddings is the scaled length already (vLLM's exception too)
        elif scaling.get("rope_type") in ("linear", "dynamic"):
            stretched = int(self.max_position_embeddings * scaling["factor"])
        elif scaling.get("rope_type") == "yarn":
            stretched = int(scaling["original_max_position_embeddings"] * scaling["factor"])
        return max(stretched, self.max_position_embeddings)

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V per token over all layers, per byte of element size."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim

    @classmethod
    def _encoder(cls, raw: dict[str, Any], architecture: str, source: str) -> ModelConfig:
        activation = raw.get("hidden_act", "gelu")
        if activation != "gelu" or raw.get("position_embedding_type", "absolute") != "absolute":
            raise UnsupportedModelError(f"{architecture} with hidden_act={activation!r} and position_embedding_type="
                                        f"{raw.get('position_embedding_type')!r} is not supported (gelu, absolute)",
                                        path=source)
        check_sizes(raw, source, epsilon="layer_norm_eps")
        hidden, heads = raw["hidden_size"], raw["num_attention_heads"]
        return cls(
            architecture=architecture, vocab_size=raw["vocab_size"], hidden_size=hidden,
            intermediate_size=raw["intermediate_size"], num_layers=raw["num_hidden_layers"], num_heads=heads,
            num_kv_heads=heads, head_dim=hidden // heads, rms_norm_eps=raw.get("layer_norm_eps", 1e-12),
            rope_theta=0.0, rope_scaling=None, max_position_embeddings=raw.get("max_position_embeddings", 512),
            tie_word_embeddings=False, qkv_bias=True, o_bias=True, mlp_bias=True, qk_norm=False,
            sliding_window=None, hidden_act="gelu", base_model=True, encoder=True,
            position_offset=raw.get("pad_token_id", 1) + 1 if architecture == "XLMRobertaModel" else 0,
        )

    @classmethod
    def from_hf(cls, raw: dict[str, Any], *, source: str = "config.json") -> ModelConfig:
        architectures = raw.get("architectures") or []
        if not isinstance(architectures, list) or not all(isinstance(name, str) for name in architectures):
            raise ModelLoadError(f"architectures must be a list of class names, got {architectures!r}",
                                 path=source)
        if encoder := next((a for a in architectures if a in ENCODERS), None):
            return cls._encoder(raw, encoder, source)
        base = next((a for a in architectures if a in BASE_MODELS), None)
        architectures = [BASE_MODELS[base]] if base else architectures
        architecture = next((a for a in architectures if a in SUPPORTED_ARCHITECTURES), None)
        if architecture is None:
            named = (f"architecture {architectures!r} is" if architectures
                     else f"no architectures are named (model_type {raw.get('model_type')!r}), which is")
            raise UnsupportedModelError(
                f"{named} not supported; "
                f"triode supports {', '.join(SUPPORTED_ARCHITECTURES)} and, as pooling models, "
                f"{', '.join((*BASE_MODELS, *ENCODERS))}",
                path=source,
            )
        prefix = ""
        if architecture == "Gemma3ForConditionalGeneration":
            # the text model alone: its config is text_config, its tensors under language_model.
            architecture, prefix = "Gemma3ForCausalLM", "language_model."
            raw = {"tie_word_embeddings": raw.get("tie_word_embeddings", True), **(raw.get("text_config") or {})}
        raw = {**DEFAULTS.get(architecture, {}), **raw}
        check_sizes(raw, source)
        num_heads = raw["num_attention_heads"]
        hidden = raw["hidden_size"]
        theta, scaling, local_theta = ropes(raw, architecture, source)
        activation = raw.get("hidden_activation") or raw.get("hidden_act") or "silu"
        if activation not in ACTIVATIONS:
            raise UnsupportedModelError(f"hidden_act={activation!r} is not supported (triode runs "
                                        f"{', '.join(ACTIVATIONS)})", path=source)
        if raw.get("use_bidirectional_attention"):
            raise UnsupportedModelError("use_bidirectional_attention=True is not supported (causal "
                                        "attention only)", path=source)
        gemma = architecture in GEMMA
        is_qwen2 = architecture == "Qwen2ForCausalLM"
        attention_bias = bool(raw.get("attention_bias", False))
        sliding, layer_types = attention_layers(raw, architecture, source)
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
            qk_norm=architecture in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM"),
            sliding_window=sliding,
            layer_types=layer_types,
            hidden_act=activation,
            gemma_norms=gemma,
            embedding_multiplier=hidden**0.5 if gemma else None,
            query_pre_attn_scalar=raw.get("query_pre_attn_scalar") if gemma else None,
            # transformers' Gemma 3 attention never applies the attention cap its config carries
            attn_logit_softcapping=(raw.get("attn_logit_softcapping")
                                    if architecture == "Gemma2ForCausalLM" else None),
            final_logit_softcapping=raw.get("final_logit_softcapping") if gemma else None,
            local_rope_theta=local_theta,
            weights_prefix=prefix,
            rotary_dim=rotary_dim(raw, architecture, source),
            base_model=base is not None,
            **experts(raw, architecture, source),
        )
