"""The torch references' attention call: scaled_dot_product_attention, plus the two score rules
the models need beyond it. Sliding windows are masks (a query at position i sees keys
i - window < j <= i, as Hugging Face masks them); tanh soft-capping of the scores (Gemma 2),
which scaled_dot_product_attention lacks, is computed as Hugging Face's eager attention does:
scores in the input dtype, softmax in float32."""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["attention", "visible_keys"]


def visible_keys(query_positions: torch.Tensor, key_positions: torch.Tensor, window: int | None) -> torch.Tensor:
    """Boolean [..., queries, keys]: which keys each query attends to (causal, and within the
    window when there is one). Positions broadcast: query_positions [..., queries, 1]."""
    visible = key_positions <= query_positions
    if window is not None:
        visible &= key_positions > query_positions - window
    return visible


def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    scale: float,
    mask: torch.Tensor | None = None,
    causal: bool = False,
    softcap: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """As F.scaled_dot_product_attention(query, key, value, ...) with ``softcap``: each scaled
    score s becomes softcap * tanh(s / softcap) before the mask and the softmax."""
    if softcap is None:
        return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, is_causal=causal,
                                              scale=scale, enable_gqa=enable_gqa)
    if enable_gqa and key.shape[-3] != query.shape[-3]:
        group = query.shape[-3] // key.shape[-3]
        key, value = key.repeat_interleave(group, dim=-3), value.repeat_interleave(group, dim=-3)
    scores = torch.matmul(query, key.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if causal:
        rows, cols = scores.shape[-2:]
        mask = torch.ones(rows, cols, dtype=torch.bool, device=scores.device).tril(cols - rows)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(weights, value)
