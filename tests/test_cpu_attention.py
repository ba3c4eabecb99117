"""Kernels: the native CPU decode attention (triode.kernels.cpu_attention) against the torch reference.

The caches are poisoned with NaN outside every sequence's tokens, so a read past a sequence's
length or outside its blocks shows in the output. Needs a C compiler; without one the module
is skipped and the fallback test below still runs. The tests that take `isa` run with this
CPU's build and with the AVX2 one, whose vectors and tiles are 8 lanes where AVX-512's are 16."""

from __future__ import annotations

import logging

import pytest
import torch

from triode import kernels
from triode.kernels import cpu_attention, cpu_elementwise, cpu_linear, native
from triode.kernels.cpu_attention import cpu_decode_available, cpu_decode_supports, paged_decode_cpu
from triode.kernels.decode_attention import decode_attention_reference
from triode.kernels.paged_attention import paged_attention_cpu, paged_attention_reference
from triode.kernels.testing import make_paged_batch

needs_kernel = pytest.mark.skipif(not cpu_decode_available(), reason="no C compiler to build the kernels")

# Context lengths: one token, a block exactly, a block and one, and longer ones.
DECODES = [(0, 1), (15, 1), (16, 1), (99, 1), (300, 1), (42, 1)]
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def _decode_batch(*, kv_heads, group, head_dim, block_size, dtype, seed=0):
    return make_paged_batch(DECODES, num_decodes=len(DECODES), kv_heads=kv_heads, group=group,
                            head_dim=head_dim, block_size=block_size, dtype=dtype, seed=seed)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("kv_heads", "group", "head_dim", "block_size"),
    # compiled for dims 16/32/64/128 and groups up to 8; the rest take the loop over query heads
    [(3, 3, 64, 16), (1, 8, 64, 16), (2, 1, 128, 16), (2, 4, 128, 16), (1, 9, 64, 32),
     (4, 1, 32, 8), (2, 2, 16, 16), (1, 5, 32, 16), (1, 6, 48, 4), (2, 2, 256, 64), (1, 9, 16, 8)],
)
def test_decode_matches_reference(kv_heads, group, head_dim, block_size, dtype, isa):
    _check_against_reference(_decode_batch(kv_heads=kv_heads, group=group, head_dim=head_dim,
                                           block_size=block_size, dtype=dtype), dtype)


@needs_kernel
@pytest.mark.parametrize(("kv_heads", "group", "head_dim"), [(3, 3, 64), (2, 4, 128), (4, 1, 32)])
@pytest.mark.parametrize("decodes", [[(300, 1)], [(15, 1), (99, 1)]])
def test_few_sequences_split_by_kv_head(decodes, kv_heads, group, head_dim, isa):
    # Fewer sequences than twice the threads: each (sequence, KV head) is its own unit of work.
    batch = make_paged_batch(decodes, num_decodes=len(decodes), kv_heads=kv_heads, group=group,
                             head_dim=head_dim, block_size=16, dtype=torch.float32, seed=5)
    _check_against_reference(batch, torch.float32)


def _check_against_reference(batch, dtype):
    md = batch.metadata
    k_clean, v_clean = batch.clean_caches(torch.float32)
    expected = decode_attention_reference(batch.query.float(), k_clean, v_clean, md.block_tables,
                                          md.seq_lens, md.max_seq_len, batch.scale)
    assert cpu_decode_supports(batch.query, batch.k_cache)
    out = torch.full_like(batch.query, float("nan"))
    paged_decode_cpu(batch.query, batch.k_cache, batch.v_cache, md.block_tables, md.seq_lens,
                     batch.scale, out)
    tolerance = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), expected, rtol=tolerance, atol=tolerance)


@needs_kernel
@pytest.mark.parametrize("head_dim", [16, 64])
def test_a_batch_large_enough_for_the_thread_team(head_dim, isa):
    """The batches above are small enough to run on the calling thread (csrc/paged_decode.h's
    PARALLEL_MIN_WORK); 8 times as many sequences open a parallel region."""
    batch = make_paged_batch(DECODES * 8, num_decodes=len(DECODES) * 8, kv_heads=3, group=3, head_dim=head_dim,
                             block_size=16, dtype=torch.float32, seed=11)
    assert sum(batch.metadata.seq_lens_host) * 9 * (head_dim + 32) >= 3 << 19
    _check_against_reference(batch, torch.float32)


@needs_kernel
@pytest.mark.parametrize("query_scale", [0.01, 30.0, 300.0])
def test_flat_and_peaked_scores(query_scale, isa):
    """Scores from nearly equal to hundreds apart: the kernel's own exponential (clamped far
    below the max) and its running-max rescaling between tiles must match torch's softmax."""
    batch = _decode_batch(kv_heads=3, group=3, head_dim=64, block_size=16, dtype=torch.float32, seed=3)
    md = batch.metadata
    query = batch.query * query_scale
    k_clean, v_clean = batch.clean_caches()
    expected = decode_attention_reference(query, k_clean, v_clean, md.block_tables, md.seq_lens,
                                          md.max_seq_len, batch.scale)
    out = torch.empty_like(query)
    paged_decode_cpu(query, batch.k_cache, batch.v_cache, md.block_tables, md.seq_lens, batch.scale, out)
    torch.testing.assert_close(out, expected, rtol=2e-5, atol=2e-5)


@needs_kernel
def test_strided_query_and_output_rows():
    """The query is a view of the fused qkv projection; out may be rows of a larger tensor."""
    batch = _decode_batch(kv_heads=3, group=3, head_dim=64, block_size=16, dtype=torch.float32)
    md = batch.metadata
    seqs, heads, dim = batch.query.shape
    fused = torch.randn(seqs, (heads + 6) * dim)
    fused[:, :heads * dim] = batch.query.reshape(seqs, -1)
    query = fused[:, :heads * dim].view(seqs, heads, dim)
    wide = torch.full((seqs, 2 * heads, dim), 7.0)
    out = wide[:, :heads]
    paged_decode_cpu(query, batch.k_cache, batch.v_cache, md.block_tables, md.seq_lens, batch.scale, out)
    k_clean, v_clean = batch.clean_caches()
    expected = decode_attention_reference(batch.query, k_clean, v_clean, md.block_tables,
                                          md.seq_lens, md.max_seq_len, batch.scale)
    torch.testing.assert_close(out, expected, rtol=2e-5, atol=2e-5)
    assert bool((wide[:, heads:] == 7.0).all())


@needs_kernel
def test_mixed_batch_takes_decodes_natively_and_prefill_as_the_reference():
    seqs = [*DECODES, (0, 9), (40, 20)]
    batch = make_paged_batch(seqs, num_decodes=len(DECODES), kv_heads=3, group=3, head_dim=64,
                             block_size=16, poison=False)
    md = batch.metadata
    args = (batch.query, batch.key, batch.value, batch.k_cache, batch.v_cache, md, batch.scale)
    torch.testing.assert_close(paged_attention_cpu(*args), paged_attention_reference(*args),
                               rtol=2e-5, atol=2e-5)


@needs_kernel
def test_block_ids_outside_the_cache_are_refused_before_the_kernel_reads():
    batch = make_paged_batch(DECODES, num_decodes=len(DECODES), kv_heads=3, group=3, head_dim=64,
                             block_size=16, poison=False)
    md = batch.metadata
    md.block_tables[2, 0] = batch.k_cache.shape[0]
    with pytest.raises(ValueError, match="block ids"):
        paged_attention_cpu(batch.query, batch.key, batch.value, batch.k_cache, batch.v_cache, md,
                            batch.scale)


@needs_kernel
def test_wrong_metadata_dtypes_are_refused():
    batch = _decode_batch(kv_heads=3, group=3, head_dim=64, block_size=16, dtype=torch.float32)
    md = batch.metadata
    out = torch.empty_like(batch.query)
    with pytest.raises(ValueError, match="int32"):
        paged_decode_cpu(batch.query, batch.k_cache, batch.v_cache, md.block_tables.long(),
                         md.seq_lens, batch.scale, out)
    with pytest.raises(ValueError, match="dtype"):
        paged_decode_cpu(batch.query, batch.k_cache, batch.v_cache, md.block_tables, md.seq_lens,
                         batch.scale, out.bfloat16())


@pytest.mark.parametrize("head_dim", [512, 40])
def test_shapes_beyond_the_kernel_take_the_reference(head_dim):
    batch = make_paged_batch([(20, 1)], num_decodes=1, kv_heads=1, group=2, head_dim=head_dim,
                             block_size=16, poison=False)
    assert not cpu_decode_supports(batch.query, batch.k_cache)
    md = batch.metadata
    args = (batch.query, batch.key, batch.value, batch.k_cache, batch.v_cache, md, batch.scale)
    torch.testing.assert_close(paged_attention_cpu(*args), paged_attention_reference(*args))


def _forget_the_library() -> None:
    for cached in (native._library, cpu_attention._bound, cpu_linear._bound, cpu_linear._invariant_entry, cpu_elementwise._bound):
        cached.cache_clear()


@needs_kernel
@pytest.mark.slow  # a third build of the kernels: about a minute on two cores
def test_a_cpu_without_avx2_still_builds_the_kernels(monkeypatch, tmp_path):
    """The library for x86-64's baseline (SSE2): the quantized kernels report themselves not
    built, and the rest, decode attention among them, runs (a unit that stopped such a build
    would leave every op on its torch reference)."""
    from triode.kernels import quant_linear

    monkeypatch.setitem(native.ISA_FLAGS, "x86-64", ("-march=x86-64",))
    monkeypatch.setattr(native, "_directory", tmp_path)
    previous = native.cpu_isa()
    native.set_cpu_isa("x86-64")
    _forget_the_library()
    try:
        assert native.native_library() is not None
        assert not quant_linear.quantized_kernels_available()
        assert not quant_linear.interleaved_kernels_available()
        assert cpu_decode_available()
        _check_against_reference(_decode_batch(kv_heads=3, group=3, head_dim=64, block_size=16,
                                               dtype=torch.float32), torch.float32)
    finally:
        native.set_cpu_isa(previous)
        _forget_the_library()


def test_without_a_compiler_the_ops_fall_back(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("CC", "/bin/false")
    monkeypatch.setattr(native, "_directory", tmp_path)
    _forget_the_library()
    try:
        with caplog.at_level(logging.WARNING, logger="triode.kernels.native"):
            assert not cpu_decode_available()
        assert "torch references" in caplog.text
        weight, x = torch.randn(8, 16), torch.randn(2, 16)
        torch.testing.assert_close(kernels.linear(x, weight), x @ weight.T)
        normed, _ = kernels.rms_norm(x, torch.ones(16), 1e-6)
        torch.testing.assert_close(normed, x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
        batch = make_paged_batch(DECODES, num_decodes=len(DECODES), kv_heads=3, group=3,
                                 head_dim=64, block_size=16, poison=False)
        md = batch.metadata
        args = (batch.query, batch.key, batch.value, batch.k_cache, batch.v_cache, md, batch.scale)
        torch.testing.assert_close(kernels.paged_attention(*args), paged_attention_reference(*args))
    finally:
        _forget_the_library()
