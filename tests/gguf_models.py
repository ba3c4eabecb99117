"""GGUF files of tiny models for the tests: written the way llama.cpp writes them (q/k rows in
its rotary order, the tokenizer in the metadata), every matrix in one block type.

The ``gguf`` package quantizes Q4_0, Q4_1 and Q8_0 but not the K types; :func:`quantize` does
those with a plain min/max rule per sub-block (llama.cpp searches for better scales; any valid
blocks serve a test whose reference is the same blocks dequantized).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize as gguf_quantize
from transformers import LlamaConfig, LlamaForCausalLM

from triode.bench.synthetic_gguf import add_bpe_tokenizer


def tiny_quantizable_llama(tokenizer) -> LlamaForCausalLM:
    """Rows of 256 so that every block type fits; weights large enough for decisive logits."""
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        tie_word_embeddings=False, eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
        pad_token_id=tokenizer.pad_token_id, rms_norm_eps=1e-5, initializer_range=0.08,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def quantize(array: np.ndarray, kind: str) -> np.ndarray:
    """uint8 [rows, bytes] blocks of ``array`` [rows, columns] in block type ``kind``."""
    array = np.ascontiguousarray(array, dtype=np.float32)
    if kind in ("Q4_K", "Q5_K"):
        return _quantize_q45_k(array, 31 if kind == "Q5_K" else 15)
    if kind == "Q6_K":
        return _quantize_q6_k(array)
    if kind == "I8":  # a type neither triode nor the gguf package dequantizes
        return np.clip(np.rint(array * 64), -128, 127).astype(np.int8).view(np.uint8)
    return gguf_quantize(array, GGMLQuantizationType[kind])


def _halves(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).view(np.uint8).reshape(*values.shape, 2)


def _quantize_q45_k(array: np.ndarray, top: int) -> np.ndarray:
    rows = array.shape[0]
    x = array.reshape(rows, -1, 8, 32)  # blocks of 256, sub-blocks of 32
    low = np.minimum(x.min(axis=-1), 0.0)
    step = (x.max(axis=-1) - low) / top
    # Scales stay normal float16 numbers (an all-zero row, such as a padding embedding, too).
    d = np.maximum(step.max(axis=-1) / 63, 1e-4)
    dmin = np.maximum((-low).max(axis=-1) / 63, 1e-4)
    d, dmin = d.astype(np.float16).astype(np.float32), dmin.astype(np.float16).astype(np.float32)
    sc = np.clip(np.rint(step / d[..., None]), 1, 63).astype(np.uint8)
    m = np.clip(np.rint(-low / dmin[..., None]), 0, 63).astype(np.uint8)
    scale = (d[..., None] * sc)[..., None]
    q = np.clip(np.rint((x + (dmin[..., None] * m)[..., None]) / scale), 0, top).astype(np.uint8)
    scales = np.zeros((*sc.shape[:2], 12), dtype=np.uint8)
    scales[..., 0:4] = sc[..., :4] | ((sc[..., 4:] >> 4) << 6)
    scales[..., 4:8] = m[..., :4] | ((m[..., 4:] >> 4) << 6)
    scales[..., 8:12] = (sc[..., 4:] & 0xF) | ((m[..., 4:] & 0xF) << 4)
    q = q.reshape(*q.shape[:2], 4, 2, 32)  # pairs of sub-blocks: low and high nibbles
    qs = ((q[..., 0, :] & 0xF) | ((q[..., 1, :] & 0xF) << 4)).reshape(*q.shape[:2], 128)
    parts = [_halves(d), _halves(dmin), scales]
    if top == 31:
        bits = (q.reshape(*q.shape[:2], 8, 32) >> 4) & 1
        parts.append((bits << np.arange(8, dtype=np.uint8)[:, None]).sum(axis=-2).astype(np.uint8))
    parts.append(qs)
    return np.concatenate(parts, axis=-1).reshape(rows, -1)


def _quantize_q6_k(array: np.ndarray) -> np.ndarray:
    rows = array.shape[0]
    x = array.reshape(rows, -1, 16, 16)  # blocks of 256, sub-blocks of 16
    step = np.abs(x).max(axis=-1) / 31
    d = np.maximum(step.max(axis=-1) / 127, 1e-4).astype(np.float16).astype(np.float32)
    sc = np.clip(np.rint(step / d[..., None]), 1, 127).astype(np.int8)
    scale = (d[..., None] * sc)[..., None]
    q = (np.clip(np.rint(x / scale), -32, 31) + 32).astype(np.uint8).reshape(*x.shape[:2], 2, 4, 32)
    ql = np.empty((*x.shape[:2], 2, 64), dtype=np.uint8)
    ql[..., 0:32] = (q[..., 0, :] & 0xF) | ((q[..., 2, :] & 0xF) << 4)
    ql[..., 32:64] = (q[..., 1, :] & 0xF) | ((q[..., 3, :] & 0xF) << 4)
    qh = sum(((q[..., s, :] >> 4) & 3) << (2 * s) for s in range(4)).astype(np.uint8)
    parts = [ql.reshape(*x.shape[:2], 128), qh.reshape(*x.shape[:2], 64), sc.view(np.uint8), _halves(d)]
    return np.concatenate(parts, axis=-1).reshape(rows, -1)


def _add_matrix(writer: gguf.GGUFWriter, name: str, array: np.ndarray, kind: str) -> None:
    """A tensor in F32, or in blocks of ``kind`` (a stack of matrices quantized row by row)."""
    if kind == "F32" or array.ndim == 1:
        writer.add_tensor(name, array)
        return
    blocks = quantize(array.reshape(-1, array.shape[-1]), kind)
    writer.add_tensor(name, blocks.reshape(*array.shape[:-1], blocks.shape[-1]), raw_dtype=GGMLQuantizationType[kind])


def _add_phi3_metadata(writer: gguf.GGUFWriter, config) -> None:
    rope = config.rope_parameters
    writer.add_rope_freq_base(rope["rope_theta"])
    head_dim = config.hidden_size // config.num_attention_heads
    writer.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
    writer.add_sliding_window(config.sliding_window)
    if rope.get("rope_type") == "longrope":
        writer.add_rope_scaling_orig_ctx_len(config.original_max_position_embeddings)
        writer.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
        writer.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))


def _add_gemma_metadata(writer: gguf.GGUFWriter, config) -> None:
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_sliding_window(config.sliding_window)
    if config.model_type == "gemma2":
        writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
        return
    full = config.rope_parameters["full_attention"]
    writer.add_rope_freq_base(full["rope_theta"])
    if full.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(full["factor"])


def _permute(weight: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's rotary layout for q/k rows (convert_hf_to_gguf.py's LlamaModel.permute)."""
    return (weight.reshape(n_head, 2, weight.shape[0] // n_head // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def write_tiny_gguf(path: Path, model, tokenizer, kind: str = "F32", kinds: Mapping[str, str] | None = None) -> None:
    """Writes ``model`` (a Llama, a Gemma 2 or 3, or a Phi-3) and its byte-level BPE tokenizer
    the way llama.cpp would: norms in F32 (Gemma's as 1 + w), Phi-3's longrope factors as
    tensors, every matrix in ``kind`` (F32 or a block
    type), or the type ``kinds`` gives its GGUF name without the layer (``attn_k``, ``output``)."""
    config = model.config
    architecture = {"gemma2": "gemma2", "gemma3_text": "gemma3", "phi3": "phi3",
                    "qwen3_moe": "qwen3moe"}.get(config.model_type, "llama")
    gemma = architecture in ("gemma2", "gemma3")
    writer = gguf.GGUFWriter(path, architecture)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    if gemma:
        _add_gemma_metadata(writer, config)
    elif architecture == "phi3":
        _add_phi3_metadata(writer, config)
    elif architecture == "qwen3moe":
        writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
        writer.add_expert_count(config.num_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    else:
        writer.add_rope_freq_base((config.rope_parameters or {}).get("rope_theta", 10000.0))
        writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
        if config.model_type == "mixtral":  # llama.cpp writes a Mixtral as a llama with experts
            writer.add_expert_count(config.num_local_experts)
            writer.add_expert_used_count(config.num_experts_per_tok)
    add_bpe_tokenizer(writer, tokenizer)
    names = {"embed_tokens": "token_embd", "norm": "output_norm", "lm_head": "output",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
             "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    if architecture == "phi3":
        names.update({"self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"})
    names["mlp.gate"] = "ffn_gate_inp"  # a MoE layer's router
    if architecture == "qwen3moe":
        names.update({"self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"})
    experts: dict[str, list[np.ndarray]] = {}  # GGUF name -> each expert's matrix, written stacked
    if gemma:
        names.update({"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
                      "post_feedforward_layernorm": "post_ffw_norm", "self_attn.q_norm": "attn_q_norm",
                      "self_attn.k_norm": "attn_k_norm"})
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        array = tensor.float().numpy().copy()
        if gemma and name.endswith("norm.weight"):
            array = array + 1.0  # llama.cpp's Gemma converter stores the (1 + w) the model scales by
        parts = name.removeprefix("model.").removesuffix(".weight").split(".")
        if parts[0] == "layers" and parts[3:4] == ["experts"]:
            # transformers holds them stacked already: gate_up_proj [E, 2I, H], down_proj [E, H, I]
            if parts[4] == "gate_up_proj":
                gate, up = np.split(array, 2, axis=1)
                experts[f"blk.{parts[1]}.ffn_gate_exps.weight"] = list(gate)
                experts[f"blk.{parts[1]}.ffn_up_exps.weight"] = list(up)
            else:
                experts[f"blk.{parts[1]}.ffn_down_exps.weight"] = list(array)
            continue
        if parts[0] == "layers":
            local = ".".join(parts[2:])
            if architecture != "llama":
                pass  # Gemma and Phi-3 rotate neox-style in llama.cpp too: no q/k permutation
            elif local == "self_attn.q_proj":
                array = _permute(array, config.num_attention_heads)
            elif local == "self_attn.k_proj":
                array = _permute(array, config.num_key_value_heads)
            gguf_name = f"blk.{parts[1]}.{names[local]}.weight"
        else:
            gguf_name = f"{names[parts[0]]}.weight"
        # llama.cpp never quantizes a MoE router (ffn_gate_inp): it stays F32
        default = "F32" if gguf_name.endswith("ffn_gate_inp.weight") else kind
        _add_matrix(writer, gguf_name, array, (kinds or {}).get(gguf_name.split(".")[-2], default))
    for gguf_name, matrices in experts.items():
        _add_matrix(writer, gguf_name, np.stack(matrices), (kinds or {}).get(gguf_name.split(".")[-2], kind))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
