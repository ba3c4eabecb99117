"""What a GGUF file's metadata (and its rope-factor tensors) say that transformers does not
read into the config it derives from them: Gemma 2's soft caps, Gemma 3's linear rope scaling
of its global layers, llama.cpp's Gemma query scale, Phi-3's window and longrope, Qwen3-MoE's
expert size, and that a llama file with experts is a Mixtral. The
conversion (:mod:`triode.engine.model_files.gguf_convert`) applies them to the config it writes."""

from __future__ import annotations

from typing import Any

# llama.cpp's Gemma 27B models scale queries by hidden / heads rather than the head size
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
# Phi-3's longrope factors, tensors of the file: into the config's rope parameters
ROPE_FACTORS = {"rope_factors_long.weight": "long_factor", "rope_factors_short.weight": "short_factor"}

__all__ = ["ROPE_FACTORS", "complete_config"]


def complete_config(raw: dict[str, Any], reader: Any) -> None:
    """Adds to ``raw`` (transformers' config of the file, as a dict) what it left out;
    ``reader``: the file's ``gguf.GGUFReader``."""
    _gemma_fields(raw, reader)
    _phi3_fields(raw, reader)
    _moe_fields(raw, reader)


def _moe_fields(raw: dict[str, Any], reader: Any) -> None:
    """Qwen3-MoE's expert size; and a llama file with experts, which is a Mixtral (transformers
    reads it as a dense Llama)."""
    if raw["architectures"][0] == "Qwen3MoeForCausalLM":
        size = _metadata(reader, "qwen3moe")("expert_feed_forward_length")
        if size:
            raw["moe_intermediate_size"] = int(size)
    elif raw["architectures"][0] in ("LlamaForCausalLM", "MistralForCausalLM"):
        value = _metadata(reader, "llama")
        if value("expert_count"):
            raw.update(architectures=["MixtralForCausalLM"], model_type="mixtral",
                       num_local_experts=int(value("expert_count")),
                       num_experts_per_tok=int(value("expert_used_count") or 2))


def _gemma_fields(raw: dict[str, Any], reader: Any) -> None:
    """What transformers does not read from a Gemma file's metadata: the rope scaling of its
    global layers, Gemma 2's soft caps, and the query scale llama.cpp uses (hidden / heads for
    the 27B models)."""
    architecture = {"Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3"}.get(raw["architectures"][0])
    if architecture is None:
        return
    value = _metadata(reader, architecture)
    for cap in ("attn_logit_softcapping", "final_logit_softcapping"):
        if value(cap) is not None:
            raw[cap] = float(value(cap))
    if value("rope.scaling.type") == "linear" and value("rope.scaling.factor"):
        scaling = {"rope_type": "linear", "factor": float(value("rope.scaling.factor"))}
        params = raw.get("rope_parameters") or {}
        if "full_attention" in params:  # transformers v5's rope per layer type: the global layers'
            params["full_attention"] = {**params["full_attention"], **scaling}
        elif "rope_theta" in params:
            params.update(scaling)
        else:
            raw["rope_scaling"] = scaling
    head_dim = raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]
    big = raw["num_hidden_layers"] == _GEMMA_27B_LAYERS[architecture]
    raw["query_pre_attn_scalar"] = raw["hidden_size"] // raw["num_attention_heads"] if big else head_dim


def _metadata(reader: Any, architecture: str) -> Any:
    """value(key): the file's ``{architecture}.{key}`` metadata (a string or a number), or None."""
    import gguf

    def value(key: str) -> Any:
        field = reader.fields.get(f"{architecture}.{key}")
        if field is None:
            return None
        part = field.parts[field.data[0]]
        return bytes(part).decode() if field.types[0] == gguf.GGUFValueType.STRING else part[0].item()

    return value


def _phi3_fields(raw: dict[str, Any], reader: Any) -> None:
    """What transformers does not read from a Phi-3 file: its window, its longrope (the
    factors are tensors of the file) and the share of each head that rotates."""
    if raw["architectures"][0] != "Phi3ForCausalLM":
        return
    value = _metadata(reader, "phi3")
    raw["sliding_window"] = value("attention.sliding_window")
    head_dim = raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]
    rotary = value("rope.dimension_count")
    if rotary and rotary != head_dim:  # Phi-4-mini rotates the leading share of each head
        raw["partial_rotary_factor"] = rotary / head_dim
        if raw.get("rope_parameters"):
            raw["rope_parameters"]["partial_rotary_factor"] = rotary / head_dim
    factors = {ROPE_FACTORS[t.name]: [float(x) for x in t.data] for t in reader.tensors if t.name in ROPE_FACTORS}
    if factors:
        rope = dict(raw.get("rope_parameters") or {"rope_theta": raw.get("rope_theta", 10000.0)})
        rope.update({"rope_type": "longrope", **factors})
        if value("rope.scaling.attn_factor") is not None:
            rope["attention_factor"] = float(value("rope.scaling.attn_factor"))
        raw["rope_parameters"] = rope
        raw.pop("rope_scaling", None)
        original = value("rope.scaling.original_context_length")
        if original:
            raw["original_max_position_embeddings"] = int(original)
