"""The mixture-of-experts MLP of Mixtral and Qwen3-MoE: a router (a linear layer to one logit
per expert), each token's top-k experts by softmax, and every expert a SiLU MLP, its weights
stacked [experts, ...] so that one tensor holds each kind. kernels.fused_experts runs the
experts as grouped matmuls (one per expert over its tokens; one grouped GEMM on CUDA).

Tensor parallelism shards every expert's intermediate features (its gate/up rows and down
columns) like a dense MLP's, with the router replicated and one all-reduce after.
"""

from __future__ import annotations

import re

import torch
from torch import nn

import kernels
from engine.model_config import ModelConfig
from engine.worker.distributed import TensorParallelGroup

# layers.N.(mlp|block_sparse_moe).experts.E.(w1|w3|gate_proj|up_proj|w2|down_proj).weight
EXPERT_TENSOR = re.compile(r"^(layers\.\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\."
                           r"(w1|w3|w2|gate_proj|up_proj|down_proj)\.weight$")
_PART = {"w1": 0, "gate_proj": 0, "w3": 1, "up_proj": 1, "w2": None, "down_proj": None}


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

    def pack(self) -> None:
        gate_up = [kernels.pack_linear_weight(w.detach()) for w in self.w_gate_up]
        down = [kernels.pack_linear_weight(w.detach()) for w in self.w_down]
        self.packed = None if any(p is None for p in gate_up + down) else (gate_up, down)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = kernels.route_experts(self.gate(x), self.top_k, normalize=self.normalize)
        out = kernels.fused_experts(x, weights, experts, self.w_gate_up, self.w_down, packed=self.packed)
        if self.parallel is not None:
            self.parallel.all_reduce(out)
        return out

    def expert_destination(self, part: str, expert: int) -> torch.Tensor:
        """Where checkpoint tensor ``part`` (w1, up_proj, down_proj, ...) of ``expert`` goes."""
        index = _PART[part]
        if index is None:
            return self.w_down.data[expert]
        return self.w_gate_up.data[expert].narrow(0, index * self.size, self.size)
