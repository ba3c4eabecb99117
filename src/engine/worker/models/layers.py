"""The layers the models build on: Linear and Embedding (whose weights may be held as quantized
parts instead of a float tensor) and RMSNorm, all through ``kernels``.

Quantized weights (a GGUF checkpoint on a CPU with the kernels): the loader
(models.weight_loading) turns the linear layers and the embedding whose checkpoint tensors are
quantized into holders of :class:`kernels.QuantizedWeight` parts before the parameters are
allocated, so the float copy is never allocated; a fused layer keeps one part per checkpoint
tensor (q, k and v may have different block types), each writing its columns of the output.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from triode import kernels
from triode.engine.worker.host_memory import weight_tensor
from triode.kernels.packed_linear import PACK_MIN_WEIGHTS

if TYPE_CHECKING:
    from triode.engine.worker.lora import LoRAStack

__all__ = ["Embedding", "Linear", "QuantizedParts", "RMSNorm", "interleaved_parts", "joined_parts"]


class QuantizedParts:
    """A module whose weight may be replaced by quantized parts (:meth:`quantize_parts`),
    stacked along the output rows, before its parameters are allocated."""

    parts: list[kernels.QuantizedWeight | None] | None = None

    def quantize_parts(self, count: int) -> None:
        del self.weight  # a registered parameter: the float copy is never allocated
        self.weight = None
        self.parts = [None] * count


def joined_parts(parts: list[kernels.QuantizedWeight]) -> list[kernels.QuantizedWeight]:
    """Quantized weights stacked along their rows as one weight (rows are independent blocks),
    when they share a block type: one kernel call instead of several. Otherwise as they are."""
    if len(parts) < 2 or len({part.kind for part in parts}) != 1:
        return parts
    rows = weight_tensor([sum(part.data.shape[0] for part in parts), parts[0].data.shape[1]], parts[0].data.dtype)
    torch.cat([part.data for part in parts], out=rows)
    return [kernels.QuantizedWeight(parts[0].kind, rows, parts[0].in_features)]


def interleaved_parts(parts: list[kernels.QuantizedWeight]) -> list[kernels.QuantizedWeight]:
    """The parts interleaved 16 rows at a time for the integer-activation kernels
    (kernels.interleaving()), when every part can be (a matrix is read as a whole, its parts'
    tiles must line up); otherwise as they are."""
    if not all(part.can_interleave() for part in parts):
        return parts
    return [part.interleave(weight_tensor) for part in parts]


class Linear(QuantizedParts, nn.Linear):
    """nn.Linear through ``kernels.linear``; on a CPU, :meth:`pack` (once the weight is loaded)
    gives it oneDNN's packed copy of the weight. With quantized parts, each part computes its
    columns of the output with the quantized kernels; :meth:`pack` joins parts of one block
    type into one weight (rows are independent blocks), so a fused layer is one kernel call.
    With LoRA enabled, the step's adapters are added to the output (``lora``)."""

    packed_weight: torch.Tensor | None = None
    lora: LoRAStack | None = None  # the adapters' weights, with --enable-lora (triode.engine.worker.lora)

    def pack(self) -> None:
        if self.parts is None:
            self.packed_weight = kernels.pack_linear_weight(self.weight.detach(), min_weights=PACK_MIN_WEIGHTS)
        else:
            self.parts = interleaved_parts(joined_parts(self.parts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self._base(x)
        if self.lora is not None:
            self.lora.add_(out, x)
        return out

    def _base(self, x: torch.Tensor) -> torch.Tensor:
        if self.parts is None:
            return kernels.linear(x, self.weight, self.bias, self.packed_weight)
        if len(self.parts) == 1:
            return self.parts[0].linear(x, self.bias)
        out = torch.empty((x.shape[0], self.out_features), dtype=torch.float32)
        start = 0
        for part in self.parts:
            stop = start + part.out_features
            part.linear(x, None if self.bias is None else self.bias[start:stop], out=out[:, start:stop])
            start = stop
        return out


class Embedding(QuantizedParts, nn.Embedding):
    """nn.Embedding; with a quantized table, the rows looked up are dequantized."""

    def reset_parameters(self) -> None:
        # The table always comes from the checkpoint; and normal_ on the meta device goes
        # through torch's refs, which import torch._dynamo (about 150 MB in every worker).
        pass

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.parts is not None:
            return self.parts[0].dequantize(ids)
        return super().forward(ids)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return kernels.rms_norm(x, self.weight, self.eps, residual)
