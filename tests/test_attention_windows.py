"""Kernels: sliding windows and soft-capped scores in paged attention. The torch reference
against a loop over every query written from the definitions (a query at position i sees keys
i - window < j <= i; each scaled score s becomes cap * tanh(s / cap)); the native CPU decode
kernel (this CPU's build and the AVX2 one) and the Triton kernels (under triton's interpreter)
against that loop. Windows smaller than a block, a block exactly, and several blocks; chunks
longer than the window; keys before a decode's window are NaN for the kernels that must never
read them."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from triode import kernels
from triode.kernels.cpu_attention import cpu_decode_available, paged_decode_cpu
from triode.kernels.paged_attention import (
    paged_attention_cpu,
    paged_attention_reference,
    paged_attention_triton,
)
from triode.kernels.prefill_attention import gather_kv
from triode.kernels.testing import make_paged_batch, triton_interpreter

BLOCK = 16
# decodes of 1, 16, 17, 60 and 130 tokens; a prompt of 45 (longer than most windows), a chunk
# of 20 after 50 cached tokens, and a chunk of 3 after 7
SEQS = [(0, 1), (15, 1), (16, 1), (59, 1), (129, 1), (0, 45), (50, 20), (7, 3)]
WINDOWS = [None, 1, 5, 16, 40]
SOFTCAPS = [None, 2.0]


def _batch(seqs=SEQS, *, dtype=torch.float32, poison=True, seed=0):
    num_decodes = min(len(seqs), 5)
    batch = make_paged_batch(seqs, num_decodes=num_decodes, kv_heads=2, group=3, head_dim=64,
                             block_size=BLOCK, dtype=dtype, poison=poison, seed=seed)
    batch.query.mul_(4.0)  # scores of several units, so that a soft cap of 2 bites
    return batch


def _expected(batch, window, softcap) -> torch.Tensor:
    md = batch.metadata
    k_cache, v_cache = batch.clean_caches(torch.float64)
    query = batch.query.double()
    group = query.shape[1] // k_cache.shape[2]
    out = torch.empty_like(query)
    for seq in range(md.num_seqs):
        start, end, seq_len = md.query_start_loc_host[seq], md.query_start_loc_host[seq + 1], md.seq_lens_host[seq]
        keys = gather_kv(k_cache, md.block_tables[seq], seq_len).repeat_interleave(group, dim=1)
        values = gather_kv(v_cache, md.block_tables[seq], seq_len).repeat_interleave(group, dim=1)
        for row in range(start, end):
            position = seq_len - (end - row)
            first = 0 if window is None else max(0, position - window + 1)
            scores = torch.einsum("hd,khd->hk", query[row], keys[first:position + 1]) * batch.scale
            if softcap is not None:
                scores = softcap * torch.tanh(scores / softcap)
            out[row] = torch.einsum("hk,khd->hd", scores.softmax(-1), values[first:position + 1])
    return out


def _poison_outside_windows(batch, window) -> None:
    """NaN in every decode's keys and values before its window."""
    md = batch.metadata
    for seq in range(md.num_decodes):
        for position in range(max(0, md.seq_lens_host[seq] - window)):
            block = int(md.block_tables[seq, position // BLOCK])
            batch.k_cache[block, position % BLOCK] = float("nan")
            batch.v_cache[block, position % BLOCK] = float("nan")


@pytest.mark.parametrize("softcap", SOFTCAPS)
@pytest.mark.parametrize("window", WINDOWS)
def test_reference_matches_definition(window, softcap):
    batch = _batch(poison=False)
    out = paged_attention_reference(batch.query, batch.key, batch.value, batch.k_cache, batch.v_cache,
                                    batch.metadata, batch.scale, window=window, softcap=softcap)
    torch.testing.assert_close(out.double(), _expected(batch, window, softcap), atol=2e-5, rtol=1e-5)


@pytest.mark.skipif(not cpu_decode_available(), reason="no C compiler to build the kernels")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("softcap", SOFTCAPS)
@pytest.mark.parametrize("window", WINDOWS)
def test_cpu_decode_kernel_reads_only_the_window(window, softcap, dtype, isa):
    batch = _batch(SEQS[:5], dtype=dtype)
    expected = _expected(batch, window, softcap)
    if window is not None:
        _poison_outside_windows(batch, window)
    md = batch.metadata
    out = torch.full_like(batch.query, float("nan"))
    paged_decode_cpu(batch.query, batch.k_cache, batch.v_cache, md.block_tables, md.seq_lens, batch.scale,
                     out, window=window, softcap=softcap)
    tolerance = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), expected, atol=tolerance, rtol=tolerance)


@pytest.mark.skipif(not cpu_decode_available(), reason="no C compiler to build the kernels")
@pytest.mark.parametrize(("window", "softcap"), [(5, None), (40, 2.0)])
def test_cpu_path_mixed_batch(window, softcap):
    batch = _batch(poison=False)
    out = paged_attention_cpu(batch.query, batch.key, batch.value, batch.k_cache, batch.v_cache,
                              batch.metadata, batch.scale, window=window, softcap=softcap)
    torch.testing.assert_close(out.double(), _expected(batch, window, softcap), atol=2e-5, rtol=1e-5)


@pytest.mark.kernels
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
@pytest.mark.parametrize("softcap", SOFTCAPS)
@pytest.mark.parametrize("window", WINDOWS)
def test_triton_matches_definition(window, softcap):
    # partitions of 32 tokens: windows start inside, at and before a partition of a decode
    batch = _batch(poison=False)
    backend = kernels.get_backend()
    try:
        with triton_interpreter():
            kernels.set_backend("triton")
            out = paged_attention_triton(batch.query, batch.k_cache, batch.v_cache, batch.metadata, batch.scale,
                                         partition_size=32, block_n=16, block_m=16, window=window,
                                         softcap=softcap)
    finally:
        kernels.set_backend(backend)
    torch.testing.assert_close(out.double(), _expected(batch, window, softcap), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize(("window", "softcap"), [(0, None), (2.5, None), (True, None), (None, 0.0), (None, -1.0)])
def test_bad_rules_are_rejected(window, softcap):
    batch = _batch(poison=False)
    with pytest.raises(ValueError, match=r"window|softcap"):
        kernels.paged_attention(batch.query, batch.key, batch.value, batch.k_cache, batch.v_cache,
                                batch.metadata, batch.scale, window=window, softcap=softcap)
