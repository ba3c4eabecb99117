"""The mixture-of-experts MLP of Mixtral and Qwen3-MoE: a router (a linear layer to one logit
per expert), each token's top-k experts by softmax, and every expert a SiLU MLP, its weights
stacked [experts, ...] so that one tensor holds each kind. kernels.fused_experts runs the
experts as grouped matmuls (one per expert over its tokens; one grouped GEMM on CUDA).

Tensor parallelism shards every expert's intermediate features (its gate/up rows and down
columns) like a dense MLP's, with the router replicated and one all-reduce after.

Quantized experts (a GGUF file's blocks, on a CPU with the kernels): :meth:`keep_quantized`
before the parameters are allocated makes the layer hold each expert's gate, up and down as
``kernels.QuantizedWeight`` instead of the stacked float tensors; its gate and up are joined
into one weight once loaded (rows are independent blocks), so an expert is two kernel calls.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from triode import kernels
from triode.engine.model.config import ModelConfig
from triode.engine.worker.distributed import TensorParallelGroup
from triode.engine.worker.models.layers import joined_parts
from triode.kernels.moe import fused_experts_reference
from triode.kernels.packed_linear import PACK_MIN_WEIGHTS

# layers.N.(mlp|block_sparse_moe).experts.E.(w1|w3|gate_proj|up_proj|w2|down_proj).weight
_EXPERT_TENSOR = re.compile(r"^(layers\.\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\."
                            r"(w1|w3|w2|gate_proj|up_proj|down_proj)\.weight$")
# an expert's three matrices: Mixtral's and Qwen3-MoE's names for each
EXPERT_PARTS = ("gate", "up", "down")
_PART = {"w1": 0, "gate_proj": 0, "w3": 1, "up_proj": 1, "w2": 2, "down_proj": 2}


def expert_tensor(name: str) -> tuple[str, int, int] | None:
    """(the MoE layer's module name, expert, part: an index of EXPERT_PARTS) of a checkpoint
    tensor name without its ``model.`` prefix, or None for any other tensor."""
    match = _EXPERT_TENSOR.match(name)
    return None if match is None else (f"{match.group(1)}.mlp", int(match.group(2)), _PART[match.group(3)])


class SparseMoE(nn.Module):
    """``router``: the [hidden -> experts] linear layer (the model's Linear, packed with the rest)."""

    def __init__(self, config: ModelConfig, router: nn.Module, parallel: TensorParallelGroup | None = None) -> None:
        super().__init__()
        size = parallel.partition.moe_intermediate_size if parallel else config.moe_intermediate_size
        experts, hidden = config.num_experts, config.hidden_size
        self.size = size
        self.top_k = config.num_experts_per_tok
        self.normalize = config.norm_topk_prob
        self.parallel = parallel
        self.gate = router
        self.w_gate_up = nn.Parameter(torch.empty(experts, 2 * size, hidden))
        self.w_down = nn.Parameter(torch.empty(experts, hidden, size))
        self.packed: tuple[list, list] | None = None  # oneDNN copies per expert, on a CPU
        # per expert [gate, up, down] (gate and up joined into one by pack), when kept quantized
        self.quantized: list[list[kernels.QuantizedWeight | None]] | None = None

    def keep_quantized(self) -> None:
        del self.w_gate_up, self.w_down  # registered parameters: never allocated
        self.w_gate_up = self.w_down = None
        self.quantized = [[None, None, None] for _ in range(self.gate.out_features)]

    def pack(self) -> None:
        if self.quantized is not None:
            self.quantized = [[*joined_parts([gate, up]), down] for gate, up, down in self.quantized]
            return
        gate_up = [kernels.pack_linear_weight(w.detach(), min_weights=PACK_MIN_WEIGHTS) for w in self.w_gate_up]
        down = [kernels.pack_linear_weight(w.detach(), min_weights=PACK_MIN_WEIGHTS) for w in self.w_down]
        self.packed = None if any(p is None for p in gate_up + down) else (gate_up, down)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = kernels.route_experts(self.gate(x), self.top_k, normalize=self.normalize)
        if self.quantized is None:
            out = kernels.fused_experts(x, weights, experts, self.w_gate_up, self.w_down, packed=self.packed)
        else:
            out = fused_experts_reference(x, weights, experts, self._quantized_gate_up,
                                          lambda rows, e: self.quantized[e][-1].linear(rows),
                                          kernels.silu_and_mul, len(self.quantized))
        if self.parallel is not None:
            self.parallel.all_reduce(out)
        return out

    def _quantized_gate_up(self, rows: torch.Tensor, expert: int) -> torch.Tensor:
        parts = self.quantized[expert][:-1]
        if len(parts) == 1:
            return parts[0].linear(rows)
        return torch.cat([part.linear(rows) for part in parts], dim=1)  # gate and up of two block types

    def expert_destination(self, part: int, expert: int) -> torch.Tensor:
        """Where part ``part`` (an index of EXPERT_PARTS) of ``expert`` goes."""
        if part == 2:
            return self.w_down.data[expert]
        return self.w_gate_up.data[expert].narrow(0, part * self.size, self.size)

    def expected_shape(self, part: int) -> tuple[int, int]:
        hidden = self.gate.in_features
        return (hidden, self.size) if part == 2 else (self.size, hidden)

    def keep(self, part: int, expert: int, weight: kernels.QuantizedWeight) -> None:
        self.quantized[expert][part] = weight
