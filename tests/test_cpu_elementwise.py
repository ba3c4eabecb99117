"""Kernels: the C versions of RMSNorm, SiLU-and-multiply, rotary embedding and the KV cache write
(triode.kernels.cpu_elementwise) against their torch references, and the dispatch to them. The C source
rounds where torch does, so bfloat16 results may differ from the reference's by an ulp or two
(silu, then the product) only where their float32 values (exp, sums in another order) straddle a
rounding midpoint: a few in ten thousand. Needs a C compiler; without one the module is skipped
(the fallback is tested in test_cpu_attention)."""

from __future__ import annotations

import pytest
import torch

from triode import kernels
from triode.engine.worker.models.rope import cos_sin_cache
from triode.kernels.cpu_elementwise import (
    rms_norm_cpu,
    rotary_embedding_cpu,
    silu_and_mul_cpu,
    write_kv_cpu,
)
from triode.kernels.kv_write import write_kv_reference
from triode.kernels.native import native_library
from triode.kernels.rms_norm import rms_norm_reference
from triode.kernels.rotary import rotary_embedding_reference
from triode.kernels.silu_mul import silu_and_mul_reference

pytestmark = pytest.mark.skipif(native_library() is None, reason="no C compiler to build the kernels")

DTYPES = [torch.float32, torch.bfloat16]


def _assert_matches(actual: torch.Tensor, expected: torch.Tensor) -> None:
    if expected.dtype == torch.bfloat16:
        assert (actual != expected).float().mean() < 0.002
        torch.testing.assert_close(actual, expected, rtol=2**-6, atol=1e-5)  # rounded twice
    else:
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


def _randn(*shape: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5, 130])  # 130 x 576 is past the threshold for threads
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_reference(rows, with_residual, dtype):
    wide = _randn(rows, 700, dtype=dtype)
    x = wide[:, :576]  # rows of a wider tensor, as a fused projection's output
    residual = _randn(rows, 576, dtype=dtype, seed=1) if with_residual else None
    weight = _randn(576, dtype=dtype, seed=2)
    normed, new_residual = rms_norm_cpu(x, weight, 1e-5, residual)
    expected, expected_residual = rms_norm_reference(x, weight, 1e-5, residual)
    _assert_matches(normed, expected)
    if with_residual:
        assert torch.equal(new_residual, expected_residual)
    else:
        assert new_residual is None


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_silu_and_mul_matches_reference(rows, dtype):
    x = _randn(rows, 2 * 1536, dtype=dtype) * 4
    _assert_matches(silu_and_mul_cpu(x), silu_and_mul_reference(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_of_gates_past_exp_range_is_finite(dtype):
    """Gates beyond +-88, where expf overflows (NaN under -ffast-math before the cap)."""
    gate = torch.tensor([[-1000.0, -150.0, -89.0, -88.0, 89.0, 150.0, 1000.0, 0.5] * 4], dtype=dtype)
    x = torch.cat([gate, torch.full_like(gate, 2.0)], dim=1)
    out = silu_and_mul_cpu(x)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), silu_and_mul_reference(x).float(), atol=1e-30, rtol=1e-2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("tokens", "heads", "kv_heads", "dim"), [(1, 9, 3, 64), (40, 4, 2, 128), (300, 2, 1, 16)]
)
def test_rotary_matches_reference_in_place(tokens, heads, kv_heads, dim, dtype):
    cache = cos_sin_cache(dim, 10000.0, None, 2048, torch.device("cpu"))
    positions = torch.randint(0, 2048, (tokens,), generator=torch.Generator().manual_seed(3))
    qkv = _randn(tokens, (heads + 2 * kv_heads) * dim, dtype=dtype)
    expected = qkv.clone()
    for tensor, apply in ((qkv, rotary_embedding_cpu), (expected, rotary_embedding_reference)):
        query = tensor[:, :heads * dim].view(tokens, heads, dim)
        key = tensor[:, heads * dim:(heads + kv_heads) * dim].view(tokens, kv_heads, dim)
        assert apply(positions, query, key, cache) in (True, None)
    _assert_matches(qkv, expected)  # the values' third is untouched in both


def test_rotary_position_outside_the_cache_raises_and_rotates_nothing():
    cache = cos_sin_cache(16, 10000.0, None, 8, torch.device("cpu"))
    query, key = torch.randn(2, 2, 16), torch.randn(2, 1, 16)
    before = query.clone(), key.clone()
    with pytest.raises(ValueError, match="outside the cache"):
        rotary_embedding_cpu(torch.tensor([3, 8]), query, key, cache)
    assert torch.equal(query, before[0]) and torch.equal(key, before[1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_matches_reference(dtype):
    tokens, kv_heads, dim = 20, 3, 64
    qkv = _randn(tokens, (9 + 2 * kv_heads) * dim, dtype=dtype)
    key = qkv[:, 9 * dim:(9 + kv_heads) * dim].view(tokens, kv_heads, dim)
    value = qkv[:, (9 + kv_heads) * dim:].view(tokens, kv_heads, dim)
    slots = torch.randperm(8 * 16, generator=torch.Generator().manual_seed(4))[:tokens]
    caches = [torch.zeros(8, 16, kv_heads, dim, dtype=dtype) for _ in range(4)]
    assert write_kv_cpu(key, value, caches[0], caches[1], slots)
    write_kv_reference(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


def test_write_kv_slot_outside_the_caches_raises_and_writes_nothing():
    key, value = torch.randn(2, 1, 8), torch.randn(2, 1, 8)
    k_cache, v_cache = torch.zeros(2, 4, 1, 8), torch.zeros(2, 4, 1, 8)
    with pytest.raises(ValueError, match="outside the caches"):
        write_kv_cpu(key, value, k_cache, v_cache, torch.tensor([1, 8]))
    assert not k_cache.any() and not v_cache.any()


def test_what_the_c_versions_do_not_take():
    x = torch.randn(4, 32)
    assert rms_norm_cpu(x.half(), torch.ones(32).half(), 1e-6) is None  # float16
    assert rms_norm_cpu(x.view(4, 2, 16), torch.ones(16), 1e-6) is None  # Qwen3's per-head norm
    assert rms_norm_cpu(x, torch.ones(32, dtype=torch.bfloat16), 1e-6) is None  # mixed dtypes
    assert rms_norm_cpu(x.t(), torch.ones(4), 1e-6) is None  # columns not contiguous
    assert rms_norm_cpu(x, torch.ones(32, device="meta"), 1e-6) is None  # a weight not on the CPU
    assert silu_and_mul_cpu(torch.randn(4, 3)) is None  # odd width
    with torch.enable_grad():
        assert silu_and_mul_cpu(x.requires_grad_()) is None  # autograd would not see it
    cache = cos_sin_cache(16, 10000.0, None, 8, torch.device("cpu"))
    query, key = torch.randn(2, 2, 16), torch.randn(2, 1, 16)
    assert not rotary_embedding_cpu(torch.tensor([1, 2], dtype=torch.int32), query, key, cache)
    assert not write_kv_cpu(torch.randn(2, 1, 8), torch.randn(2, 1, 8), torch.zeros(2, 4, 1, 8),
                            torch.zeros(2, 4, 1, 8), torch.tensor([0, 1], dtype=torch.int32))


def test_dispatch_takes_the_c_versions_and_torch_when_forced(monkeypatch):
    calls = []
    for name in ("rms_norm_cpu", "silu_and_mul_cpu", "rotary_embedding_cpu", "write_kv_cpu"):
        original = getattr(kernels, name)
        def counted(*args, _original=original, _name=name, **kwargs):
            calls.append(_name)
            return _original(*args, **kwargs)

        monkeypatch.setattr(kernels, name, counted)
    x, cache = torch.randn(3, 2 * 16), cos_sin_cache(16, 10000.0, None, 8, torch.device("cpu"))
    query, key = torch.randn(3, 2, 16), torch.randn(3, 1, 16)

    def run_all():
        kernels.rms_norm(x, torch.ones(32), 1e-6)
        kernels.silu_and_mul(x)
        kernels.rotary_embedding(torch.tensor([0, 1, 2]), query, key, cache)
        caches = torch.zeros(1, 4, 1, 16), torch.zeros(1, 4, 1, 16)
        kernels.write_kv(key, key, *caches, torch.tensor([0, 1, 2]))

    run_all()
    assert calls == ["rms_norm_cpu", "silu_and_mul_cpu", "rotary_embedding_cpu", "write_kv_cpu"]
    calls.clear()
    kernels.set_backend("torch")
    try:
        run_all()
    finally:
        kernels.set_backend("auto")
    assert calls == []
