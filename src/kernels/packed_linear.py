"""Linear layers on CPUs through oneDNN, with each weight packed once at load time.

torch's CPU ``F.linear`` goes to MKL, which at a decode step's shapes runs far below what the
core can do (the default model's matmuls on this 2-core Zen 4, float32: 84 GFLOP/s at 32 rows,
106 at 64; MKL is slowest on the 49152-row LM head). oneDNN, which torch also ships, reaches
192 and 208 at those sizes once the weight is reordered into its blocked layout, and the
reorder is paid once instead of per call. Decode steps of the default model (ms, MKL or the C
loop -> packed): float32 2 rows 43 -> 37, 8 rows 66 -> 39, 32 rows 118 -> 79, 64 rows 175 ->
148; bfloat16 4 rows 32 -> 22, 64 rows 116 -> 91. One row stays with the C loop of
:mod:`triode.kernels.cpu_linear` (22 ms against 32 in float32, 16 against 23 in bfloat16).

The packed copy is kept beside the plain weight, which the one-row loop and the torch
reference read (and, for a tied LM head, the embedding), so on a CPU the linear weights take
twice their memory. The two oneDNN entry points used are the ones torch's own compiler uses
for frozen CPU models.
"""

from __future__ import annotations

import torch

# Rows oneDNN lays the packed weight out for; any row count runs with it. 128 was as fast as
# a hint of 32 or 64 at every size from 4 to 512 rows, and a little faster at 128.
PACK_ROWS_HINT = 128
PACKED_DTYPES = (torch.float32, torch.bfloat16)
# Weights below this many elements are not worth packing: oneDNN's call costs 15-20 us however
# small the matrix, torch's matmul 2-4 (Intel Xeon, 2 threads; 64 x 192 weights: 17.2 against
# 3.4 us at one row, 23.7 against 8.5 at 64, 35.1 against 19.8 at 256).
PACK_MIN_WEIGHTS = 1 << 16

__all__ = ["PACKED_DTYPES", "PACK_MIN_WEIGHTS", "onednn_packs", "pack_linear_weight", "packed_linear", "packed_linear_supports"]


def _onednn_available() -> bool:
    ops = torch.ops.mkldnn
    return (torch.backends.mkldnn.is_available() and hasattr(ops, "_reorder_linear_weight")
            and hasattr(ops, "_linear_pointwise"))


def onednn_packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN packs weights of ``dtype`` on this CPU. Its bfloat16 path needs AVX-512
    (BW, VL, DQ) or AVX-NE-CONVERT; an AVX2-only CPU refuses it at the reorder."""
    if dtype not in PACKED_DTYPES or not _onednn_available():
        return False
    return dtype != torch.bfloat16 or torch.ops.mkldnn._is_mkldnn_bf16_supported()


def pack_linear_weight(weight: torch.Tensor, *, min_weights: int = 0) -> torch.Tensor | None:
    """oneDNN's packed copy of ``weight`` [out, in], or None where packing does not apply: not a
    CPU tensor, a dtype oneDNN does not pack here (see :func:`onednn_packs`), a weight autograd
    tracks, fewer than ``min_weights`` elements (models pass :data:`PACK_MIN_WEIGHTS`)."""
    if (weight.device.type != "cpu" or weight.dim() != 2 or weight.requires_grad
            or weight.numel() < min_weights or not onednn_packs(weight.dtype)):
        return None
    with torch.inference_mode():
        return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PACK_ROWS_HINT)


def packed_linear_supports(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether :func:`packed_linear` takes these tensors: CPU rows [rows, in] of the packed
    weight's dtype and width, a bias of that dtype, and no autograd to record."""
    return (
        x.device.type == "cpu"
        and x.dim() == 2
        and x.dtype == packed.dtype
        and x.shape[1] == packed.shape[1]
        and not (torch.is_grad_enabled() and x.requires_grad)
        and (bias is None or (bias.dtype == x.dtype and bias.shape == packed.shape[:1]))
    )


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` with the weight as :func:`pack_linear_weight` packed it."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")
