"""Inputs and the comparison shared by the tests of triode's CPU linear paths."""

from __future__ import annotations

import torch

# float32: the order of a sum; bfloat16: rounded inputs and outputs
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
SHAPES = [(576, 192, False), (37, 50, True), (16, 1, True)]  # (features, out, with_bias)


def linear_inputs(rows: int, features: int, out: int, with_bias: bool, dtype: torch.dtype):
    """(x, weight, bias) of a seeded random linear layer."""
    gen = torch.Generator().manual_seed(rows * 1000 + features)
    x = torch.randn(rows, features, generator=gen).to(dtype)
    weight = torch.randn(out, features, generator=gen).to(dtype)
    bias = torch.randn(out, generator=gen).to(dtype) if with_bias else None
    return x, weight, bias


def assert_matches_linear(result: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias) -> None:
    """``result`` is F.linear(x, weight, bias), computed in float32, within the dtype's tolerance."""
    expected = torch.nn.functional.linear(x.float(), weight.float(), None if bias is None else bias.float())
    tolerance = TOLERANCE[x.dtype]
    torch.testing.assert_close(result.float(), expected, rtol=tolerance, atol=tolerance * x.shape[1] ** 0.5)
