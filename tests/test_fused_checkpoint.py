"""Unit tests: checkpoints with fused q/k/v and gate/up tensors (Phi-3's) read as separate
parts (triode.engine.worker.models.fused_checkpoint): the row cut, a tensor-parallel rank's slice of
each part, quantized rows, and a fused tensor of the wrong size named with its file."""

from __future__ import annotations

import pytest
import torch

from triode import kernels
from triode.engine.errors import ModelLoadError
from triode.engine.model.config import ModelConfig
from triode.engine.worker.models.fused_checkpoint import unfuse, unfused_names

CONFIG = ModelConfig.from_hf({
    "architectures": ["Phi3ForCausalLM"], "vocab_size": 50, "hidden_size": 32, "intermediate_size": 24,
    "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
})  # head_dim 8: q 32 rows, k and v 16 each


def test_fused_tensors_are_cut_into_their_parts_and_others_pass():
    qkv = torch.arange(64 * 32, dtype=torch.float32).view(64, 32)
    gate_up = torch.randn(48, 32)
    norm = torch.ones(32)
    parts = dict(unfuse([("model.layers.0.self_attn.qkv_proj.weight", qkv),
                         ("model.layers.0.mlp.gate_up_proj.weight", gate_up),
                         ("model.layers.0.input_layernorm.weight", norm)], CONFIG, source="ckpt"))
    assert list(parts) == ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
                           "model.layers.0.self_attn.v_proj.weight", "model.layers.0.mlp.gate_proj.weight",
                           "model.layers.0.mlp.up_proj.weight", "model.layers.0.input_layernorm.weight"]
    assert torch.equal(torch.cat([parts[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"]), qkv)
    assert torch.equal(parts["model.layers.0.mlp.up_proj.weight"], gate_up[24:])
    assert parts["model.layers.0.input_layernorm.weight"] is norm


def test_a_rank_keeps_its_slice_of_each_part():
    qkv = torch.arange(64, dtype=torch.float32)[:, None].repeat(1, 32)

    def second_half(name):  # what a rank of two keeps of each part, as checkpoint_slices says
        rows = {"q_proj": 32, "k_proj": 16, "v_proj": 16}[name.split(".")[-2]]
        return (0, rows // 2, rows)

    parts = dict(unfuse([("layers.0.self_attn.qkv_proj.weight", qkv)], CONFIG, slice_of=second_half, source="c"))
    assert [int(t[0, 0]) for t in parts.values()] == [16, 40, 56]
    assert [t.shape[0] for t in parts.values()] == [16, 8, 8]


def test_quantized_fused_rows_stay_quantized():
    data = torch.randint(0, 255, (48, 34), dtype=torch.uint8)  # Q8_0: 32 weights in 34 bytes
    parts = dict(unfuse([("mlp.gate_up_proj.weight", kernels.QuantizedWeight("Q8_0", data, 32))], CONFIG,
                        source="c"))
    gate, up = parts["mlp.gate_proj.weight"], parts["mlp.up_proj.weight"]
    assert gate.kind == up.kind == "Q8_0" and torch.equal(up.data, data[24:])
    assert unfused_names({"mlp.gate_up_proj.weight": "Q8_0", "lm_head.weight": "Q6_K"}, CONFIG) == {
        "mlp.gate_proj.weight": "Q8_0", "mlp.up_proj.weight": "Q8_0", "lm_head.weight": "Q6_K"}


def test_a_fused_tensor_of_the_wrong_size_is_named():
    with pytest.raises(ModelLoadError, match=r"ckpt: tensor 'self_attn.qkv_proj.weight' has 60 rows, "
                                             r"expected 64 \(32 \+ 16 \+ 16\)"):
        list(unfuse([("self_attn.qkv_proj.weight", torch.zeros(60, 32))], CONFIG, source="ckpt"))
