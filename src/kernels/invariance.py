"""Batch invariance: whether every op must give a row the same bits whatever else its call
holds (``--batch-invariant``; docs/architecture.md, "Batch invariance").

The setting is per process (a worker sets it from its :class:`~triode.engine.config.EngineArgs`).
Each op honours it on its own path: the C kernels in their fixed-order forms, the Triton kernels
with fixed tilings (:mod:`triode.kernels.invariant_matmul` for linear layers), and the torch
references one row at a time, as here, because torch's matmul and attention choose their
blocking, and with it the order of each sum, from the whole batch's shape.
"""

from __future__ import annotations

import torch

__all__ = ["batch_invariant", "invariant_linear_reference", "set_batch_invariant"]

_batch_invariant = False


def set_batch_invariant(on: bool) -> None:
    """From now on in this process, whether each row's result must be independent of the
    other rows of a call (at a cost where the fastest kernels are not)."""
    global _batch_invariant
    _batch_invariant = bool(on)


def batch_invariant() -> bool:
    return _batch_invariant


def invariant_linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight.T + bias`` one row at a time: every row is the same one-row matmul, on a
    fresh copy (the BLAS kernels' order can follow a row's address alignment)."""
    if x.shape[0] == 0:
        return torch.nn.functional.linear(x, weight, bias)
    return torch.cat([torch.nn.functional.linear(x[row:row + 1].clone(), weight, bias)
                      for row in range(x.shape[0])])
