"""Unit tests of the CPU decode path's length buckets: sans-IO grouping, and the bucketed
attention equal to attention computed one sequence at a time."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from triode.kernels.paged_attention import (
    BUCKET_FLOOR_TOKENS,
    BUCKET_MIN_SHARE,
    length_buckets,
    paged_attention_reference,
)
from triode.kernels.prefill_attention import gather_kv
from triode.kernels.testing import make_paged_batch


@given(st.lists(st.integers(1, 2000), max_size=64), st.sampled_from([1, 16, 32]))
def test_every_sequence_lands_in_exactly_one_bucket_that_fits_it(lengths, block_size):
    buckets = length_buckets(lengths, block_size)
    members = sorted(i for indices, _ in buckets for i in indices)
    assert members == list(range(len(lengths)))
    for indices, padded in buckets:
        assert padded % block_size == 0
        assert padded == max(-(-lengths[i] // block_size) * block_size for i in indices)
        if padded > BUCKET_FLOOR_TOKENS:
            assert all(lengths[i] > BUCKET_MIN_SHARE * padded - block_size for i in indices)
    assert [padded for _, padded in buckets] == sorted((p for _, p in buckets), reverse=True)


def test_similar_lengths_share_one_bucket_and_spread_ones_do_not():
    assert len(length_buckets([100, 120, 128, 30], 16)) == 1
    assert len(length_buckets([512, 500, 300, 100, 40], 16)) == 3


def _one_sequence_at_a_time(batch) -> torch.Tensor:
    md = batch.metadata
    rows = []
    for seq in range(md.num_decodes):
        length = md.seq_lens_host[seq]
        keys = gather_kv(batch.k_cache, md.block_tables[seq], length)
        values = gather_kv(batch.v_cache, md.block_tables[seq], length)
        q = batch.query[seq].unsqueeze(1)  # [heads, 1, dim]
        k, v = keys.transpose(0, 1), values.transpose(0, 1)  # [kv_heads, length, dim]
        rows.append(F.scaled_dot_product_attention(q, k, v, scale=batch.scale, enable_gqa=True).squeeze(1))
    return torch.stack(rows)


@pytest.mark.parametrize("group", [1, 3])
def test_bucketed_decode_attention_equals_attention_per_sequence(group):
    lengths = [700, 40, 512, 17, 300, 301, 1, 96, 650, 129]
    assert len(length_buckets(lengths, 16)) >= 3
    seqs = [(length - 1, 1) for length in lengths] + [(5, 7)]  # and one prefill chunk after them
    batch = make_paged_batch(seqs, num_decodes=len(lengths), kv_heads=2, group=group, head_dim=32,
                             block_size=16, poison=False)
    out = paged_attention_reference(batch.query, batch.key, batch.value, batch.k_cache,
                                    batch.v_cache, batch.metadata, batch.scale)
    expected = _one_sequence_at_a_time(batch)
    torch.testing.assert_close(out[:len(lengths)], expected, rtol=1e-5, atol=1e-5)
