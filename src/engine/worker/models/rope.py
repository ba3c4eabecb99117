"""Rotary-embedding frequencies for the rope types the supported configs use (default, linear,
llama3, yarn, dynamic, longrope), computed the way Hugging Face computes them (same float32
operations), so positions rotate identically."""

from __future__ import annotations

import math
from typing import Any

import torch


def inverse_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> tuple[torch.Tensor, float]:
    """The rotation frequencies and the factor cos and sin are scaled by (1 but for yarn); a
    dynamic or longrope rope's frequencies depend on the position (cos_sin_cache)."""
    pos_freqs = theta ** _exponents(head_dim)
    if scaling is not None and scaling["rope_type"] == "yarn":
        return _yarn(head_dim, theta, pos_freqs, scaling)
    inv_freq = 1.0 / pos_freqs
    if scaling is None:
        return inv_freq, 1.0
    if scaling["rope_type"] == "linear":
        return inv_freq / scaling["factor"], 1.0
    if scaling["rope_type"] == "llama3":
        return _llama3(inv_freq, scaling), 1.0
    raise ValueError(f"rope type {scaling['rope_type']!r} has no position-independent frequencies")


def _exponents(head_dim: int) -> torch.Tensor:
    """2i / head_dim for each pair of dimensions, in float32 as transformers makes them."""
    return torch.arange(0, head_dim, 2, dtype=torch.int64).to(dtype=torch.float) / head_dim


def _yarn(head_dim: int, theta: float, pos_freqs: torch.Tensor, scaling: dict[str, Any]) -> tuple[torch.Tensor, float]:
    # YaRN: dimensions that turn fewer than beta_slow times over the original context are
    # interpolated (slowed by `factor`), those turning more than beta_fast times kept, a linear
    # ramp between; cos and sin grow by 0.1 ln(factor) + 1 (or the configured ratio).
    factor = scaling["factor"]
    original = scaling["original_max_position_embeddings"]
    attention = scaling.get("attention_factor")
    if attention is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention = _yarn_mscale(factor)

    def dimension_turning(times: float) -> float:
        return head_dim * math.log(original / (times * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dimension_turning(scaling.get("beta_fast") or 32), dimension_turning(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    kept = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - kept) + (1.0 / pos_freqs) * kept
    return inv_freq, float(attention)


def _dynamic_ntk(head_dim: int, theta: float, scaling: dict[str, Any], max_positions: int) -> torch.Tensor:
    # Dynamic NTK: past the pretraining length L, a token at position p rotates with the base
    # grown for a sequence of p + 1, as transformers computes it when tokens come one at a
    # time (float32 tensors, in its order). Its one-shot prefill of a prompt longer than L
    # instead rotates every prompt token for the prompt's whole length, which depends on how
    # the prompt is cut: a function of the position alone keeps chunked prefill and prefix
    # reuse exact, and agrees with transformers for prompts shorter than L.
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]
    exponents = _exponents(head_dim)
    growth = head_dim / (head_dim - 2)
    base = theta * ((factor * original / original) - (factor - 1)) ** growth
    inv_freq = (1.0 / (base**exponents)).repeat(max_positions, 1)
    if max_positions > original:
        sequence = torch.arange(original, max_positions, dtype=torch.int64) + 1
        grown = theta * ((factor * sequence / original) - (factor - 1)) ** growth
        inv_freq[original:] = 1.0 / (grown[:, None] ** exponents[None, :])
    return inv_freq


def _longrope(head_dim: int, theta: float, scaling: dict[str, Any], max_positions: int) -> tuple[torch.Tensor, float]:
    # LongRoPE (Phi-3): each frequency slowed by its own factor, the short list's for a
    # sequence within the pretraining length L, the long list's past it; cos and sin grow by
    # sqrt(1 + ln(factor) / ln(L)). transformers switches lists for the whole batch once its
    # longest sequence passes L; a position's own length decides here, which agrees for
    # sequences within L and keeps chunked prefill and prefix reuse exact.
    original, factor = scaling["original_max_position_embeddings"], scaling["factor"]
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    pos_freqs = theta ** _exponents(head_dim)
    short = 1.0 / (torch.tensor(scaling["short_factor"], dtype=torch.float32) * pos_freqs)
    long = 1.0 / (torch.tensor(scaling["long_factor"], dtype=torch.float32) * pos_freqs)
    inv_freq = short.repeat(max_positions, 1)
    inv_freq[original:] = long
    return inv_freq, float(attention)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _llama3(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, and the band in
    # between interpolated smoothly.
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    original_context = scaling["original_max_position_embeddings"]
    low_freq_wavelen = original_context / low_freq_factor
    high_freq_wavelen = original_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def cos_sin_cache(
    head_dim: int,
    theta: float,
    scaling: dict[str, Any] | None,
    max_positions: int,
    device: torch.device,
) -> torch.Tensor:
    """[max_positions, head_dim] float32: cos of the frequencies, then sin (both scaled by the
    rope type's attention factor, as Hugging Face scales them)."""
    positions = torch.arange(max_positions, dtype=torch.float)
    attention = 1.0
    if scaling is not None and scaling["rope_type"] == "dynamic":
        freqs = positions[:, None] * _dynamic_ntk(head_dim, theta, scaling, max_positions)
    elif scaling is not None and scaling["rope_type"] == "longrope":
        inv_freq, attention = _longrope(head_dim, theta, scaling, max_positions)
        freqs = positions[:, None] * inv_freq
    else:
        inv_freq, attention = inverse_frequencies(head_dim, theta, scaling)
        freqs = positions[:, None] * inv_freq[None, :]
    freqs = freqs.to(device)
    cos, sin = freqs.cos(), freqs.sin()
    if attention != 1.0:
        cos, sin = cos * attention, sin * attention
    return torch.cat((cos, sin), dim=-1)

