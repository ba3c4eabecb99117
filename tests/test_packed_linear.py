"""Kernels: linear layers through oneDNN with packed weights (triode.kernels.packed_linear) against
torch.nn.functional.linear, the dispatch between them and the C loop, and the model packing
every linear weight once it is loaded."""

from __future__ import annotations

import pytest
import torch

from tests.hf_compare import make_driver
from tests.linear_compare import SHAPES, assert_matches_linear, linear_inputs
from triode import kernels
from triode.engine.worker.models.llama import Linear
from triode.kernels.native import native_library
from triode.kernels.packed_linear import (
    PACK_MIN_WEIGHTS,
    onednn_packs,
    pack_linear_weight,
    packed_linear,
    packed_linear_supports,
)

needs_onednn = pytest.mark.skipif(pack_linear_weight(torch.zeros(2, 2)) is None,
                                  reason="this torch has no oneDNN")
pytestmark = pytest.mark.kernels


@needs_onednn
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 7, 33, 130])
@pytest.mark.parametrize(("features", "out", "with_bias"), SHAPES)
def test_matches_torch_linear(rows, features, out, with_bias, dtype):
    x, weight, bias = linear_inputs(rows, features, out, with_bias, dtype)
    if not onednn_packs(dtype):
        pytest.skip(f"oneDNN does not pack {dtype} on this CPU")
    packed = pack_linear_weight(weight)
    assert packed_linear_supports(x, packed, bias)
    result = packed_linear(x, packed, bias)
    assert result.shape == (rows, out) and result.dtype == dtype
    assert_matches_linear(result, x, weight, bias)


@needs_onednn
def test_strided_rows_are_copied_not_misread():
    wide = torch.randn(5, 2 * 64)
    x = wide[:, :64]
    weight = torch.randn(96, 64)
    torch.testing.assert_close(packed_linear(x, pack_linear_weight(weight)), x @ weight.T,
                               rtol=1e-5, atol=1e-5)


def test_what_is_not_packed():
    if not onednn_packs(torch.bfloat16):  # AVX2 only: the model keeps the C loop and MKL
        assert pack_linear_weight(torch.zeros(4, 8, dtype=torch.bfloat16)) is None
    assert pack_linear_weight(torch.zeros(4, 8, device="meta")) is None
    assert pack_linear_weight(torch.zeros(4, 8, dtype=torch.float16)) is None
    assert pack_linear_weight(torch.zeros(8)) is None
    assert pack_linear_weight(torch.nn.Linear(8, 4).weight) is None  # autograd tracks it


@needs_onednn
def test_what_packed_linear_does_not_take():
    packed = pack_linear_weight(torch.randn(8, 16))
    assert not packed_linear_supports(torch.randn(2, 17), packed, None)
    assert not packed_linear_supports(torch.randn(2, 16, dtype=torch.bfloat16), packed, None)
    assert not packed_linear_supports(torch.randn(2, 3, 16), packed, None)
    assert not packed_linear_supports(torch.randn(2, 16), packed, torch.randn(7))
    assert not packed_linear_supports(torch.randn(2, 16, requires_grad=True), packed, None)


@needs_onednn
def test_dispatch_one_row_to_the_loop_more_to_onednn(monkeypatch):
    taken = []

    def recording(x, packed, bias=None):
        taken.append(x.shape[0])
        return packed_linear(x, packed, bias)

    monkeypatch.setattr(kernels, "packed_linear", recording)
    weight = torch.randn(32, 16)
    packed = pack_linear_weight(weight)
    for rows in (1, 2, 8, 64):
        x = torch.randn(rows, 16)
        torch.testing.assert_close(kernels.linear(x, weight, packed=packed), x @ weight.T, rtol=1e-5, atol=1e-5)
    # without a C compiler the single row goes to oneDNN as well
    assert taken == ([2, 8, 64] if native_library() is not None else [1, 2, 8, 64])
    kernels.set_backend("torch")
    try:
        kernels.linear(torch.randn(4, 16), weight, packed=packed)
    finally:
        kernels.set_backend("auto")
    assert len(taken) == (3 if native_library() is not None else 4)


@needs_onednn
def test_the_model_packs_every_linear_weight_worth_it(tiny_model_factory):
    """Weights of PACK_MIN_WEIGHTS elements or more are packed, smaller ones left to torch
    (oneDNN's per-call cost is more than their multiply): an MLP of 1024 packs, the 64-wide
    attention matrices do not."""
    tied = make_driver(tiny_model_factory("llama", tie_word_embeddings=True, num_key_value_heads=4,
                                          intermediate_size=1024, vocab_size=1024))
    untied = make_driver(tiny_model_factory("qwen2"))
    for model in (tied.runner.model, untied.runner.model):
        layers = [m for m in model.modules() if isinstance(m, Linear)]
        assert layers and all((m.packed_weight is not None) == (m.weight.numel() >= PACK_MIN_WEIGHTS) for m in layers)
    tied_layers = [m for m in tied.runner.model.modules() if isinstance(m, Linear)]
    assert {m.packed_weight is None for m in tied_layers} == {True, False}
    assert tied.runner.model.lm_head is None and tied.runner.model.tied_head_packed is not None
    assert untied.runner.model.tied_head_packed is None
