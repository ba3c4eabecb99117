"""The Llama family's decoder layers as one C call per decode step (``kernels.DecodeStack``),
when the model is one that call computes exactly as the modules do: on a CPU, float32, one
rank, Llama's layer (no per-head q/k norm, SiLU, no soft cap, one rope), and every layer's four matrices held as quantized blocks (a GGUF
or ``--quantization`` model). Any other model, and any step the stack does not take, runs
the modules. With LoRA enabled the layers' adapter stacks go with them (``kernels.lora``)."""

from __future__ import annotations

import torch

from triode import kernels
from triode.kernels.cpu_attention import HEAD_DIM_MULTIPLE, MAX_BLOCK_SIZE, MAX_HEAD_DIM, MAX_HEADS
from triode.kernels.decode_stack import DecodeLayerWeights, DecodeStack, decode_stack_available

__all__ = ["build_decode_stack", "decode_stack_supported"]


def _parts(linear) -> list[tuple[kernels.QuantizedWeight, torch.Tensor | None]] | None:
    """(part, its share of the bias) for each quantized part of a Linear, or None."""
    if linear.parts is None or any(part is None for part in linear.parts):
        return None
    parts, start = [], 0
    for part in linear.parts:
        stop = start + part.out_features
        parts.append((part, None if linear.bias is None else linear.bias[start:stop]))
        start = stop
    return parts


def _layer_weights(layer) -> DecodeLayerWeights | None:
    attention, mlp = layer.self_attn, layer.mlp
    matrices = [_parts(m) for m in (attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj)]
    if any(parts is None for parts in matrices):
        return None
    qkv, o, gate_up, down = matrices
    lora = tuple(None if m.lora is None else (m.lora.a, m.lora.b, m.lora.slices)
                 for m in (attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj))
    return DecodeLayerWeights(
        input_norm=layer.input_layernorm.weight.detach(),
        post_attention_norm=layer.post_attention_layernorm.weight.detach(),
        qkv=qkv, o=o, gate_up=gate_up, down=down, window=attention.window, lora=lora,
    )


def decode_stack_supported(model) -> bool:
    """Whether ``model`` (a LlamaForCausalLM) is one the stack computes exactly as its modules."""
    config = model.config
    norm = model.norm.weight
    return (
        model.parallel is None
        and not config.qk_norm
        and not config.gemma_norms
        and config.hidden_act == "silu"
        and config.attn_logit_softcapping is None
        and config.local_rope_theta is None
        and not config.num_experts
        and config.rope_dim == config.head_dim
        and norm.device.type == "cpu"
        and norm.dtype == torch.float32
        and config.head_dim % HEAD_DIM_MULTIPLE == 0
        and config.head_dim <= MAX_HEAD_DIM
        and config.num_heads <= MAX_HEADS
        and config.num_heads % config.num_kv_heads == 0
        and all(_layer_weights(layer) is not None for layer in model.layers)
        and decode_stack_available()
    )


def build_decode_stack(model, kv_caches) -> DecodeStack | None:
    """The stack over ``kv_caches`` (float32 caches of blocks the kernel takes), or None."""
    k_cache = kv_caches[0][0]
    if k_cache.dtype != torch.float32 or k_cache.shape[1] > MAX_BLOCK_SIZE:
        return None
    config = model.config
    return DecodeStack(
        [_layer_weights(layer) for layer in model.layers], kv_caches,
        num_heads=config.num_heads, intermediate_size=config.intermediate_size,
        eps=config.rms_norm_eps, scale=model.layers[0].self_attn.scale, rope_cache=model.rope_cache,
    )
