"""Kernels: the mixture-of-experts MLP (triode.kernels.moe). Routing against its definition; the
grouped expert matmul (torch, and Triton under triton's interpreter) against a loop over every
token and its k experts; experts that get no token, and a batch of one token."""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from triode.kernels.moe import fused_experts_reference, fused_experts_triton, route
from triode.kernels.silu_mul import silu_and_mul_reference
from triode.kernels.testing import triton_interpreter

E, K, HIDDEN, INTERMEDIATE = 8, 2, 48, 40


def _weights(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(E, 2 * INTERMEDIATE, HIDDEN, generator=gen) * 0.2,
            torch.randn(E, HIDDEN, INTERMEDIATE, generator=gen) * 0.2)


def _per_token(x, weights, experts, w_gate_up, w_down):
    out = torch.zeros_like(x)
    for token in range(x.shape[0]):
        for slot in range(experts.shape[1]):
            e = int(experts[token, slot])
            gate, up = (x[token] @ w_gate_up[e].T).chunk(2)
            out[token] += weights[token, slot] * ((F.silu(gate) * up) @ w_down[e].T)
    return out


def test_route_is_softmax_then_top_k_then_renormalised():
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0], [3.0, 3.0, 0.0, 0.0]])
    weights, experts = route(logits, 2, normalize=True)
    assert experts[0].tolist() == [1, 2] and set(experts[1].tolist()) == {0, 1}
    probs = logits.softmax(-1)
    torch.testing.assert_close(weights[0], probs[0, [1, 2]] / probs[0, [1, 2]].sum())
    raw, _ = route(logits, 2, normalize=False)  # Qwen3-MoE with norm_topk_prob off
    torch.testing.assert_close(raw[0], probs[0, [1, 2]])


@pytest.mark.parametrize("tokens", [1, 5, 37])
def test_grouped_matmul_matches_a_loop_over_tokens(tokens):
    w_gate_up, w_down = _weights()
    x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(tokens))
    weights, experts = route(torch.randn(tokens, E, generator=torch.Generator().manual_seed(1)), K, normalize=True)
    out = fused_experts_reference(x, weights, experts, lambda rows, e: rows @ w_gate_up[e].T,
                                  lambda rows, e: rows @ w_down[e].T, silu_and_mul_reference, E)
    torch.testing.assert_close(out, _per_token(x, weights, experts, w_gate_up, w_down), atol=1e-5, rtol=1e-5)


@pytest.mark.kernels
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
@pytest.mark.parametrize("tokens", [1, 37, 90])
def test_triton_grouped_gemm_matches_a_loop_over_tokens(tokens):
    w_gate_up, w_down = _weights(seed=2)
    x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(3))
    # experts 0 and 7 get nobody; the others runs of different lengths (at 90 tokens, runs of
    # about 30 rows: two blocks of 16 an expert, the last one partial)
    experts = torch.randint(1, 7, (tokens, K), generator=torch.Generator().manual_seed(4))
    experts[:, 1] = (experts[:, 0] % 6) + 1
    weights = torch.rand(tokens, K, generator=torch.Generator().manual_seed(5))
    with triton_interpreter():
        out = fused_experts_triton(x, weights, experts, w_gate_up, w_down, silu_and_mul_reference)
    torch.testing.assert_close(out, _per_token(x, weights, experts, w_gate_up, w_down), atol=1e-5, rtol=1e-5)
