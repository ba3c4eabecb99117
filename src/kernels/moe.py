"""Mixture-of-experts MLP: each token's top-k experts, run as one matmul per expert over the
tokens routed to it (a loop over experts, never over tokens).

``route`` turns router logits into (weights, experts) as Mixtral and Qwen3-MoE do: softmax in
float32 over every expert, the top k, renormalised to sum to one when the model says so.
``group_by_expert`` sorts the (token, slot) pairs by expert once per layer call. The torch path
(``fused_experts_reference``, and on a CPU with ``packed`` oneDNN copies of each expert's
weights) multiplies each expert's contiguous run of rows; the Triton path launches one grouped
GEMM over all experts for gate/up and one for down (the grid walks blocks of BLOCK_M rows of one
expert's run, padded to whole blocks), with the activation between and the weighted sum after.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import attrs
import torch

from triode.kernels._jit import cdiv, lazy_jit

if TYPE_CHECKING:
    import triton.language as tl

__all__ = ["ExpertGroups", "fused_experts_reference", "fused_experts_triton", "group_by_expert", "route"]

Linear = Callable[[torch.Tensor, int], torch.Tensor]  # (rows, expert) -> rows @ weight[expert].T


def route(logits: torch.Tensor, top_k: int, *, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [tokens, k] float32, experts [tokens, k] int64) from router logits [tokens, E]."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


@attrs.frozen
class ExpertGroups:
    """The (token, slot) pairs of a batch sorted by expert: ``tokens[i]`` is the token of
    sorted pair i, ``offsets[e]:offsets[e + 1]`` expert e's run, ``counts_host`` its length."""

    order: torch.Tensor  # [tokens * k] int64: flat (token * k + slot) index of each sorted pair
    tokens: torch.Tensor  # [tokens * k] int64
    offsets: torch.Tensor  # [E + 1] int64
    counts_host: tuple[int, ...]


def group_by_expert(experts: torch.Tensor, num_experts: int) -> ExpertGroups:
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    offsets = torch.zeros(num_experts + 1, dtype=torch.int64, device=flat.device)
    torch.cumsum(counts, 0, out=offsets[1:])
    return ExpertGroups(order, order // experts.shape[1], offsets, tuple(counts.tolist()))


def _combine(expert_out: torch.Tensor, groups: ExpertGroups, weights: torch.Tensor, tokens: int) -> torch.Tensor:
    """sum over a token's k slots of weight * its expert's output, [tokens, hidden], added in
    the order of the token's experts: the same order whatever the batch (a scatter-add would
    take it from the atomics' timing on CUDA)."""
    scaled = expert_out * weights.reshape(-1)[groups.order, None].to(expert_out.dtype)
    top_k = weights.shape[1]
    # sorted pair i is slot order[i] of its token; per token, its pairs in expert order
    position = torch.empty_like(groups.order)
    position[groups.order] = torch.arange(groups.order.shape[0], device=position.device)
    by_expert = position.reshape(tokens, top_k).sort(dim=1).values
    out = scaled[by_expert[:, 0]]
    for slot in range(1, top_k):
        out = out + scaled[by_expert[:, slot]]
    return out


def fused_experts_reference(
    x: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    gate_up: Linear,
    down: Linear,
    act_and_mul: Callable[[torch.Tensor], torch.Tensor],
    num_experts: int,
) -> torch.Tensor:
    """x [tokens, hidden]; ``gate_up(rows, e)`` / ``down(rows, e)`` multiply rows by expert e's
    [2I, hidden] / [hidden, I] weight (a plain or a packed matmul). Returns [tokens, hidden]."""
    groups = group_by_expert(experts, num_experts)
    rows = x.index_select(0, groups.tokens)
    parts = []
    start = 0
    for expert, count in enumerate(groups.counts_host):
        if count:
            parts.append(down(act_and_mul(gate_up(rows[start:start + count], expert)), expert))
        start += count
    expert_out = torch.cat(parts) if parts else rows.new_zeros((0, x.shape[1]))
    return _combine(expert_out, groups, weights, x.shape[0])


@lazy_jit
def _grouped_gemm_kernel(
    out_ptr,
    a_ptr,
    w_ptr,
    a_rows_ptr,
    block_experts_ptr,
    block_starts_ptr,
    block_stops_ptr,
    n,
    k,
    stride_a,
    stride_we,
    stride_wn,
    stride_out,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # Program (row block, column block): rows start..stop of the sorted pairs, all of one
    # expert; out[row] = a[a_rows[row]] @ w[expert].T over columns of this block.
    block = tl.program_id(0)
    expert = tl.load(block_experts_ptr + block).to(tl.int64)
    start = tl.load(block_starts_ptr + block)
    stop = tl.load(block_stops_ptr + block)
    offs_m = start + tl.arange(0, BLOCK_M)
    m_mask = offs_m < stop
    a_rows = tl.load(a_rows_ptr + offs_m, mask=m_mask, other=0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < n
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, k, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < k
        a = tl.load(a_ptr + a_rows[:, None] * stride_a + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :],
                    other=0.0)
        w = tl.load(w_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None],
                    mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc += tl.dot(a, w, input_precision=DOT_PRECISION)
    tl.store(out_ptr + offs_m.to(tl.int64)[:, None] * stride_out + offs_n[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def _blocks(groups: ExpertGroups, block_m: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """(expert, start, stop) of every block of up to block_m rows of one expert's run."""
    counts = torch.tensor(groups.counts_host, dtype=torch.int64, device=device)
    per_expert = (counts + block_m - 1) // block_m
    total = sum(-(-count // block_m) for count in groups.counts_host)
    experts = torch.repeat_interleave(torch.arange(len(groups.counts_host), device=device), per_expert,
                                      output_size=total)
    first_block = torch.cumsum(per_expert, 0) - per_expert
    starts = groups.offsets[experts] + (torch.arange(total, device=device) - first_block[experts]) * block_m
    stops = torch.minimum(starts + block_m, groups.offsets[experts + 1])
    return tuple(t.to(torch.int32) for t in (experts, starts, stops))


def _grouped_gemm(a: torch.Tensor, a_rows: torch.Tensor, w: torch.Tensor, blocks: Sequence[torch.Tensor],
                  rows: int, block_m: int) -> torch.Tensor:
    """out [rows, N]: row i is a[a_rows[i]] @ w[expert of i's block].T (w [E, N, K])."""
    _, n, k = w.shape
    out = torch.empty((rows, n), dtype=a.dtype, device=a.device)
    block_n = 64 if n >= 64 else max(16, 1 << (n - 1).bit_length())
    _grouped_gemm_kernel[(blocks[0].shape[0], cdiv(n, block_n))](
        out, a, w, a_rows, *blocks, n, k, a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=32,
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
    )
    return out


def fused_experts_triton(
    x: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    act_and_mul: Callable[[torch.Tensor], torch.Tensor],
    *,
    block_m: int = 16,
) -> torch.Tensor:
    """As :func:`fused_experts_reference` with the experts' weights stacked: ``w_gate_up``
    [E, 2I, hidden], ``w_down`` [E, hidden, I], contiguous, on the launch device."""
    num_experts = w_gate_up.shape[0]
    if block_m < 16 or block_m & (block_m - 1):
        raise ValueError(f"block_m: expected a power of two >= 16, got {block_m}")
    if not (w_gate_up.is_contiguous() and w_down.is_contiguous() and x.stride(1) == 1
            and w_down.shape[0] == num_experts and w_down.shape[2] * 2 == w_gate_up.shape[1]
            and w_gate_up.shape[2] == w_down.shape[1] == x.shape[1]):
        raise ValueError(f"fused_experts_triton: expected x [tokens, H], w_gate_up [E, 2I, H] and w_down [E, H, I] "
                         f"contiguous; got {list(x.shape)}, {list(w_gate_up.shape)}, {list(w_down.shape)}")
    groups = group_by_expert(experts, num_experts)
    pairs = groups.tokens.shape[0]
    if pairs == 0:
        return torch.zeros_like(x)
    blocks = _blocks(groups, block_m, x.device)
    hidden = _grouped_gemm(x, groups.tokens, w_gate_up, blocks, pairs, block_m)
    activated = act_and_mul(hidden).contiguous()
    identity = torch.arange(pairs, dtype=torch.int64, device=x.device)
    expert_out = _grouped_gemm(activated, identity, w_down, blocks, pairs, block_m)
    return _combine(expert_out, groups, weights, x.shape[0])
