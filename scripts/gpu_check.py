#!/usr/bin/env python3
"""GPU check of triode's Triton kernels: correctness against the torch references at realistic
sizes, timings, and achieved memory bandwidth as a share of the device's peak.

    python scripts/gpu_check.py              # on a CUDA machine, < 5 minutes
    python scripts/gpu_check.py --dry-run-cpu  # same logic, tiny, interpreter

Needs only torch, triton and src/kernels. For each op it compares the Triton kernel and the
torch reference (the engine's CPU path, run here on the GPU in the same dtype) with a float32
"gold" run of the reference on the upcast inputs, by ||out - gold|| / ||gold||; NaN never
passes, outputs are poisoned with NaN before each launch so unwritten elements show, and the
caches hold NaN outside every context. Decode attention and KV write report GB/s and their share
of the peak copy bandwidth measured in the same run (and of the vendor's 4.8 TB/s on an H200);
attention is shown side by side with torch.nn.functional.scaled_dot_product_attention on the
same data gathered into contiguous K/V. Timings are triton.testing.do_bench medians.

Exit status: 0 all good, 1 a mismatch or an error, 2 no CUDA device (or no triton),
3 the time budget ran out before every case ran.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

from source_tree import use_source_tree

use_source_tree()  # triode without an install: a bare GPU machine has only torch and triton

EXIT_OK, EXIT_MISMATCH, EXIT_NO_DEVICE, EXIT_BUDGET = 0, 1, 2, 3
VENDOR_PEAK = {"H200": 4.8e12, "H100": 3.35e12}


@dataclass
class Row:
    op: str
    case: str
    error: float | None = None  # ||triton - gold|| / ||gold||
    ref_error: float | None = None  # the same for the torch reference in the working dtype
    ok: bool = True
    triton_us: float | None = None
    ref_us: float | None = None
    sdpa_us: float | None = None
    bytes_moved: int | None = None
    flops: float | None = None
    note: str = ""


@dataclass
class Context:
    torch: object
    device: object
    dtype: object
    gpu: bool
    peak_copy: float = 0.0  # bytes/s
    vendor_peak: float | None = None
    rows: list[Row] = field(default_factory=list)
    deadline: float = math.inf


# --------------------------------------------------------------------------- timing


def make_timer(ctx: Context) -> Callable[[Callable[[], object]], float]:
    """Median microseconds of fn: triton.testing.do_bench on CUDA, a wall clock on CPU."""
    if ctx.gpu:
        from triton.testing import do_bench

        def bench(fn):
            try:
                ms = do_bench(fn, warmup=10, rep=40, return_mode="median")
            except TypeError:  # an older do_bench without return_mode
                ms = do_bench(fn, warmup=10, rep=40)
            return 1000.0 * ms

        return bench

    def wall(fn):
        fn()
        start = time.perf_counter()
        fn()
        return 1e6 * (time.perf_counter() - start)

    return wall


def measure_peak_copy(ctx: Context, bench) -> float:
    torch = ctx.torch
    size = (1 << 30) if ctx.gpu else (1 << 24)
    src = torch.empty(size, dtype=torch.uint8, device=ctx.device).random_(0, 255)
    dst = torch.empty_like(src)
    us = bench(lambda: dst.copy_(src))
    return 2 * size / (us * 1e-6)


# --------------------------------------------------------------------------- comparison


def relative_error(torch, actual, gold) -> float:
    actual, gold = actual.double(), gold.double()
    if not bool(torch.isfinite(actual).all()):
        return math.inf
    return float((actual - gold).norm() / gold.norm().clamp_min(1e-30))


# ||out - gold|| / ||gold|| allowed per working dtype: float32 arithmetic lands far below 1e-4;
# half-precision operands (probabilities rounded before P @ V, outputs rounded) near their ulp.
TOLERANCE = {"float32": 1e-4, "float16": 5e-3, "bfloat16": 2e-2}


def judge(ctx: Context, row: Row, actual, gold, reference=None) -> None:
    torch = ctx.torch
    row.error = relative_error(torch, actual, gold)
    if reference is not None:
        row.ref_error = relative_error(torch, reference, gold)
    limit = TOLERANCE[str(actual.dtype).removeprefix("torch.")]
    if not row.error <= limit:
        row.ok = False
        row.note = (row.note + f" error {row.error:.2e} > {limit:.0e}").strip()


def poisoned(torch, like):
    return torch.full(like.shape, float("nan"), dtype=like.dtype, device=like.device)


# --------------------------------------------------------------------------- cases


def check_decode(ctx: Context, bench, batch_size: int, context: int, *, heads=32, kv_heads=8,
                 head_dim=128, block_size=16, dtype=None, timed=True, seed=0, bound=None) -> Row:
    """``bound``: launch with this max_seq_len (and a block table that wide) instead of the
    batch's own, as a captured decode graph does with max_model_len."""
    torch = ctx.torch
    import torch.nn.functional as F

    from triode.kernels.decode_attention import decode_attention_reference, decode_attention_triton
    from triode.kernels.testing import make_paged_batch

    dtype = dtype or ctx.dtype
    label = f"b{batch_size} ctx{context} h{heads}/{kv_heads} d{head_dim} bs{block_size} {str(dtype)[6:]}"
    if bound:
        label += f" launched for {bound}"
    row = Row("decode attention", label)
    # Lengths vary a little (not multiples of the block size) unless timed for SDPA, where
    # the batch must be rectangular.
    seqs = [(context - 1 if timed else max(0, context - 1 - (i * 37) % max(1, context // 3)), 1)
            for i in range(batch_size)]
    batch = make_paged_batch(seqs, num_decodes=batch_size, kv_heads=kv_heads, group=heads // kv_heads,
                             head_dim=head_dim, block_size=block_size, dtype=dtype,
                             device=ctx.device, seed=seed)
    md = batch.metadata
    args = (md.block_tables, md.seq_lens, md.max_seq_len, batch.scale)
    launch = args
    if bound:
        extra = -(-bound // block_size) - md.block_tables.shape[1]
        launch = (torch.nn.functional.pad(md.block_tables, (0, max(0, extra))).contiguous(), md.seq_lens, bound,
                  batch.scale)
    out = poisoned(torch, batch.query)
    decode_attention_triton(batch.query, batch.k_cache, batch.v_cache, *launch, out=out)
    k32, v32 = batch.clean_caches(torch.float32)
    gold = decode_attention_reference(batch.query.float(), k32, v32, *args)
    del k32, v32
    k_clean, v_clean = batch.clean_caches()
    reference = decode_attention_reference(batch.query, k_clean, v_clean, *args)
    judge(ctx, row, out, gold, reference)
    del gold
    if timed:
        row.bytes_moved = batch.kv_bytes + 2 * batch.query.numel() * batch.query.element_size()
        row.triton_us = bench(lambda: decode_attention_triton(batch.query, batch.k_cache,
                                                              batch.v_cache, *args, out=out))
        row.ref_us = bench(lambda: decode_attention_reference(batch.query, k_clean, v_clean, *args))
        # SDPA on the same data gathered into contiguous [batch, kv_heads, len, dim]
        blocks = -(-context // block_size)
        table = md.block_tables[:, :blocks].long()
        k = batch.k_cache[table].flatten(1, 2)[:, :context].transpose(1, 2).contiguous()
        v = batch.v_cache[table].flatten(1, 2)[:, :context].transpose(1, 2).contiguous()
        q = batch.query.unsqueeze(2)  # [batch, heads, 1, dim]
        row.sdpa_us, sdpa_note = time_sdpa(torch, F, bench, q, k, v, batch.scale, causal=False)
        row.note = (row.note + " " + sdpa_note).strip()
        del k, v
    return row


def time_sdpa(torch, F, bench, q, k, v, scale, *, causal):
    """SDPA with GQA if this torch supports it there, else with K/V expanded to every head."""
    try:
        F.scaled_dot_product_attention(q, k, v, scale=scale, is_causal=causal, enable_gqa=True)
        return bench(lambda: F.scaled_dot_product_attention(q, k, v, scale=scale, is_causal=causal,
                                                            enable_gqa=True)), ""
    except (RuntimeError, TypeError):
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        return bench(lambda: F.scaled_dot_product_attention(q, k, v, scale=scale, is_causal=causal)), \
            "sdpa: K/V expanded"


def check_paged(ctx: Context, bench, name: str, seqs, num_decodes: int, *, heads=32, kv_heads=8,
                head_dim=128, block_size=16, dtype=None, timed=True, sdpa=False, seed=1, window=None,
                softcap=None) -> Row:
    """The whole paged attention (decode + prefill kernels) on a batch of (prefix, chunk), with
    a sliding window and a soft cap on the scores when given."""
    torch = ctx.torch
    import torch.nn.functional as F

    from triode.kernels.paged_attention import paged_attention_reference, paged_attention_triton
    from triode.kernels.testing import make_paged_batch

    dtype = dtype or ctx.dtype
    row = Row("paged attention", f"{name} h{heads}/{kv_heads} d{head_dim} bs{block_size} {str(dtype)[6:]}")
    batch = make_paged_batch(seqs, num_decodes=num_decodes, kv_heads=kv_heads, group=heads // kv_heads,
                             head_dim=head_dim, block_size=block_size, dtype=dtype,
                             device=ctx.device, seed=seed)
    md = batch.metadata
    rules = {"window": window, "softcap": softcap}
    out = poisoned(torch, batch.query)
    paged_attention_triton(batch.query, batch.k_cache, batch.v_cache, md, batch.scale, out=out, **rules)
    k32, v32 = batch.clean_caches(torch.float32)
    gold = paged_attention_reference(batch.query.float(), batch.key.float(), batch.value.float(),
                                     k32, v32, md, batch.scale, **rules)
    del k32, v32
    k_clean, v_clean = batch.clean_caches()
    reference = paged_attention_reference(batch.query, batch.key, batch.value, k_clean, v_clean,
                                          md, batch.scale, **rules)
    judge(ctx, row, out, gold, reference)
    del gold
    # causal flops: each query row attends to prefix + its position + 1 keys
    row.flops = float(sum(4 * heads * head_dim * (chunk * prefix + chunk * (chunk + 1) / 2)
                          for prefix, chunk in seqs))
    if timed:
        row.triton_us = bench(lambda: paged_attention_triton(batch.query, batch.k_cache, batch.v_cache,
                                                             md, batch.scale, out=out))
        row.ref_us = bench(lambda: paged_attention_reference(batch.query, batch.key, batch.value,
                                                             k_clean, v_clean, md, batch.scale))
    if timed and sdpa and num_decodes == 0 and len(set(seqs)) == 1 and seqs[0][0] == 0:
        # rectangular, prefix-free batch: SDPA on [batch, heads, len, dim], causal
        chunk = seqs[0][1]
        q = batch.query.view(len(seqs), chunk, heads, head_dim).transpose(1, 2)
        k = batch.key.view(len(seqs), chunk, kv_heads, head_dim).transpose(1, 2)
        v = batch.value.view(len(seqs), chunk, kv_heads, head_dim).transpose(1, 2)
        row.sdpa_us, sdpa_note = time_sdpa(torch, F, bench, q, k, v, batch.scale, causal=True)
        row.note = (row.note + " " + sdpa_note).strip()
    return row


def check_write_kv(ctx: Context, bench, tokens: int, *, kv_heads=8, head_dim=128, block_size=16,
                   dtype=None) -> Row:
    torch = ctx.torch
    from triode.kernels.kv_write import write_kv_reference, write_kv_triton

    dtype = dtype or ctx.dtype
    row = Row("KV write", f"{tokens} tokens kv{kv_heads} d{head_dim} bs{block_size} {str(dtype)[6:]}")
    num_blocks = -(-tokens // block_size) * 2 + 3
    gen = torch.Generator(device=ctx.device).manual_seed(tokens)
    # key/value as strided views of a fused qkv output, as the model passes them
    qkv = torch.randn(tokens, (4 + 2) * kv_heads * head_dim, device=ctx.device, generator=gen).to(dtype)
    key = qkv[:, 4 * kv_heads * head_dim:5 * kv_heads * head_dim].view(tokens, kv_heads, head_dim)
    value = qkv[:, 5 * kv_heads * head_dim:].view(tokens, kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size, device=ctx.device, generator=gen)[:tokens]
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype, device=ctx.device)
    v_cache = torch.full(shape, float("nan"), dtype=dtype, device=ctx.device)
    k_expected, v_expected = k_cache.clone(), v_cache.clone()
    write_kv_triton(key, value, k_cache, v_cache, slots)
    write_kv_reference(key, value, k_expected, v_expected, slots)
    same = torch.equal(k_cache.nan_to_num(7.0), k_expected.nan_to_num(7.0)) and \
        torch.equal(v_cache.nan_to_num(7.0), v_expected.nan_to_num(7.0))
    row.error = 0.0 if same else math.inf
    if not same:
        row.ok, row.note = False, "caches differ from the reference (must be bit-identical)"
    row.bytes_moved = 2 * 2 * tokens * kv_heads * head_dim * key.element_size() + 8 * tokens
    row.triton_us = bench(lambda: write_kv_triton(key, value, k_cache, v_cache, slots))
    row.ref_us = bench(lambda: write_kv_reference(key, value, k_expected, v_expected, slots))
    return row


def check_rms_norm(ctx: Context, bench, tokens: int, hidden: int, *, residual: bool, dtype=None) -> Row:
    torch = ctx.torch
    from triode.kernels.rms_norm import rms_norm_reference, rms_norm_triton

    dtype = dtype or ctx.dtype
    row = Row("rms_norm", f"{tokens}x{hidden}{' +residual' if residual else ''} {str(dtype)[6:]}")
    gen = torch.Generator(device=ctx.device).manual_seed(hidden)
    x = torch.randn(tokens, hidden, device=ctx.device, generator=gen).to(dtype)
    r = torch.randn(tokens, hidden, device=ctx.device, generator=gen).to(dtype) if residual else None
    w = (1 + 0.1 * torch.randn(hidden, device=ctx.device, generator=gen)).to(dtype)
    out, new_r = rms_norm_triton(x, w, 1e-6, r)
    gold, gold_r = rms_norm_reference(x.float(), w.float(), 1e-6, r.float() if residual else None)
    reference, _ = rms_norm_reference(x, w, 1e-6, r)
    judge(ctx, row, out, gold, reference)
    if residual and relative_error(torch, new_r, gold_r) > TOLERANCE[str(dtype)[6:]]:
        row.ok, row.note = False, "new residual differs"
    mismatched = int((out != reference).sum())
    row.note = (row.note + f" {mismatched} elements differ from the reference").strip()
    row.bytes_moved = (2 + 2 * residual) * x.numel() * x.element_size() + w.numel() * w.element_size()
    row.triton_us = bench(lambda: rms_norm_triton(x, w, 1e-6, r))
    row.ref_us = bench(lambda: rms_norm_reference(x, w, 1e-6, r))
    return row


def check_rotary(ctx: Context, bench, tokens: int, *, heads=32, kv_heads=8, head_dim=128,
                 max_positions=32768, dtype=None) -> Row:
    torch = ctx.torch
    from triode.kernels.rotary import rotary_embedding_reference, rotary_embedding_triton
    from triode.kernels.testing import rope_cache

    dtype = dtype or ctx.dtype
    row = Row("rotary", f"{tokens} tokens h{heads}/{kv_heads} d{head_dim} {str(dtype)[6:]}")
    gen = torch.Generator(device=ctx.device).manual_seed(tokens)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, device=ctx.device, generator=gen).to(dtype)
    query = qkv[:, :heads * head_dim].view(tokens, heads, head_dim)
    key = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    positions = torch.randint(0, max_positions, (tokens,), device=ctx.device, generator=gen)
    cache = rope_cache(max_positions, head_dim, device=ctx.device)
    gold_q, gold_k = query.to(torch.float32, copy=True), key.to(torch.float32, copy=True)
    rotary_embedding_reference(positions, gold_q, gold_k, cache)
    ref_q, ref_k = query.clone(), key.clone()
    rotary_embedding_reference(positions, ref_q, ref_k, cache)
    q, k = query.clone(), key.clone()
    rotary_embedding_triton(positions, q, k, cache)
    judge(ctx, row, torch.cat([q.flatten(), k.flatten()]), torch.cat([gold_q.flatten(), gold_k.flatten()]),
          torch.cat([ref_q.flatten(), ref_k.flatten()]))
    mismatched = int((q != ref_q).sum() + (k != ref_k).sum())
    row.note = (row.note + f" {mismatched} elements differ from the reference").strip()
    row.bytes_moved = 2 * (query.numel() + key.numel()) * query.element_size()
    row.triton_us = bench(lambda: rotary_embedding_triton(positions, query, key, cache))
    row.ref_us = bench(lambda: rotary_embedding_reference(positions, query, key, cache))
    return row


def check_silu(ctx: Context, bench, tokens: int, intermediate: int, *, dtype=None) -> Row:
    torch = ctx.torch
    from triode.kernels.silu_mul import silu_and_mul_reference, silu_and_mul_triton

    dtype = dtype or ctx.dtype
    row = Row("silu_and_mul", f"{tokens}x2*{intermediate} {str(dtype)[6:]}")
    gen = torch.Generator(device=ctx.device).manual_seed(intermediate)
    x = torch.randn(tokens, 2 * intermediate, device=ctx.device, generator=gen).to(dtype)
    out = silu_and_mul_triton(x)
    reference = silu_and_mul_reference(x)
    judge(ctx, row, out, silu_and_mul_reference(x.float()), reference)
    mismatched = int((out != reference).sum())
    row.note = (row.note + f" {mismatched} elements differ from the reference").strip()
    row.bytes_moved = (x.numel() + out.numel()) * x.element_size()
    row.triton_us = bench(lambda: silu_and_mul_triton(x))
    row.ref_us = bench(lambda: silu_and_mul_reference(x))
    return row


def check_lora(ctx: Context, bench, tokens: int, hidden: int, kv: int, *, rank=16, slots=4, dtype=None) -> Row:
    """Batched LoRA on a fused qkv projection's output: four adapters' segments of rows, rows of
    the base model between them, and an empty segment, against the row-at-a-time definition."""
    torch = ctx.torch
    from triode.kernels.lora import LoRASegments, add_lora_reference, add_lora_triton

    dtype = dtype or ctx.dtype
    row = Row("lora", f"{tokens} rows, qkv {hidden}+2*{kv}, rank {rank}, {slots} adapters {str(dtype)[6:]}")
    gen = torch.Generator(device=ctx.device).manual_seed(tokens)
    slices = (hidden, kv, kv)
    x = torch.randn(tokens, hidden, device=ctx.device, generator=gen).to(dtype)
    a = (torch.randn(slots, hidden, 3 * rank, device=ctx.device, generator=gen) / hidden**0.5).to(dtype)
    b = (torch.randn(slots, rank, sum(slices), device=ctx.device, generator=gen) * 0.1).to(dtype)
    out = torch.randn(tokens, sum(slices), device=ctx.device, generator=gen).to(dtype)
    quarter = tokens // 4
    segments = LoRASegments((0, quarter, quarter, 2 * quarter + 1), (quarter - 1, quarter, 2 * quarter, tokens),
                            (3, 0, 1, 2))
    gold = out.clone().float()
    add_lora_reference(gold, x.float(), a.float(), b.float(), slices, segments)
    reference = out.clone()
    add_lora_reference(reference, x, a, b, slices, segments)
    actual = out.clone()
    add_lora_triton(actual, x, a, b, slices, segments)
    judge(ctx, row, actual, gold, reference)
    row.flops = 2.0 * tokens * rank * (3 * hidden + sum(slices))
    row.triton_us = bench(lambda: add_lora_triton(out.clone(), x, a, b, slices, segments))
    return row


def check_invariant_linear(ctx: Context, bench, features: int, out_features: int, *, dtype=None) -> Row:
    """--batch-invariant's linear layer: a row's bits alone and at a random place among 2, 7,
    64, 300 (and 2048) rows; accuracy and time against torch's matmul (cuBLAS) at the largest."""
    torch = ctx.torch
    from triode.kernels.invariant_matmul import invariant_linear_triton

    dtype = dtype or ctx.dtype
    row = Row("invariant linear", f"{features}->{out_features} {str(dtype)[6:]}")
    gen = torch.Generator(device=ctx.device).manual_seed(features)
    weight = (torch.randn(out_features, features, device=ctx.device, generator=gen) / features ** 0.5).to(dtype)
    x = torch.randn(1, features, device=ctx.device, generator=gen).to(dtype)
    alone = invariant_linear_triton(x, weight)[0]
    sizes = (2, 7, 64, 300, 2048) if ctx.gpu else (2, 7, 40)
    differ = []
    for size in sizes:
        batch = torch.randn(size, features, device=ctx.device, generator=gen).to(dtype)
        place = size // 3
        batch[place] = x[0]
        if not torch.equal(invariant_linear_triton(batch, weight)[place], alone):
            differ.append(size)
    judge(ctx, row, invariant_linear_triton(batch, weight), batch.float() @ weight.float().T,
          torch.nn.functional.linear(batch, weight))
    if differ:
        row.ok = False
        row.note = (row.note + f" the row differs among {differ} rows").strip()
    row.flops = 2.0 * batch.shape[0] * features * out_features
    row.triton_us = bench(lambda: invariant_linear_triton(batch, weight))
    row.ref_us = bench(lambda: torch.nn.functional.linear(batch, weight))
    return row


def check_invariant_attention(ctx: Context, name: str, seqs, num_decodes: int, **shape) -> Row:
    """--batch-invariant's attention: every row of a mixed batch gets the bits of its own decode
    launched alone (the tiling fixed, whatever the batch)."""
    torch = ctx.torch
    from triode.kernels.decode_attention import launch_decode
    from triode.kernels.invariance import set_batch_invariant
    from triode.kernels.paged_attention import _rows_as_decodes, paged_attention_triton
    from triode.kernels.testing import make_paged_batch

    row = Row("invariant attention", f"{name} {str(ctx.dtype)[6:]}")
    batch = make_paged_batch(seqs, num_decodes=num_decodes, dtype=ctx.dtype, device=ctx.device, seed=7, **shape)
    md = batch.metadata
    set_batch_invariant(True)
    try:
        out = paged_attention_triton(batch.query, batch.k_cache, batch.v_cache, md, batch.scale)
        tables, lengths = _rows_as_decodes(md)
        rows = range(0, out.shape[0], max(1, out.shape[0] // 64))
        differ = 0
        for r in rows:
            alone = torch.empty_like(out[r:r + 1])
            launch_decode(batch.query[r:r + 1], batch.k_cache, batch.v_cache, tables[r:r + 1], lengths[r:r + 1],
                          int(lengths[r]), batch.scale, alone, None, None, invariant=True)
            differ += not torch.equal(alone, out[r:r + 1])
    finally:
        set_batch_invariant(False)
    if differ:
        row.ok = False
    row.note = f"{differ} of {len(rows)} rows differ from their decode alone"
    return row


# --------------------------------------------------------------------------- plan


def plan(ctx: Context, bench) -> list[tuple[str, Callable[[], Row]]]:
    torch = ctx.torch
    c = ctx
    if ctx.gpu:
        decode = [(1, 32768), (8, 32768), (64, 8192), (256, 2048), (256, 4096)]
        prefill = [
            ("4x4096 no prefix", [(0, 4096)] * 4, 0, True),
            ("8x1024 after 3072 cached", [(3072, 1024)] * 8, 0, False),
            ("128 decodes @2000 + 2 chunks", [(1999, 1)] * 128 + [(1000, 1024), (0, 777)], 128, False),
        ]
        variants = [  # correctness only: other dtypes, head dims, GQA ratios, block sizes
            dict(dtype=torch.float32, heads=32, kv_heads=8, head_dim=128, block_size=16),
            dict(dtype=torch.float16, heads=32, kv_heads=32, head_dim=64, block_size=32),
            dict(dtype=torch.bfloat16, heads=24, kv_heads=8, head_dim=128, block_size=32),
            dict(dtype=torch.bfloat16, heads=14, kv_heads=2, head_dim=64, block_size=16),
        ]
        variant_decode = (48, 3001)
        variant_mixed = [(1000, 1)] * 16 + [(0, 1)] * 2 + [(333, 300), (0, 517)]
        write_sizes = [256, 32768]
        layer = dict(tokens=4096, hidden=4096, intermediate=14336)
    else:  # tiny shapes for the interpreter
        decode = [(2, 300), (3, 70)]
        prefill = [
            ("2x40 no prefix", [(0, 40)] * 2, 0, True),
            ("2 decodes + 2 chunks", [(50, 1), (0, 1), (37, 20), (0, 9)], 2, False),
        ]
        variants = [
            dict(dtype=torch.float16, heads=4, kv_heads=1, head_dim=64, block_size=16),
            dict(dtype=torch.float32, heads=3, kv_heads=1, head_dim=128, block_size=32),
        ]
        variant_decode = (3, 90)
        variant_mixed = [(40, 1), (0, 1), (20, 17)]
        write_sizes = [7, 40]
        layer = dict(tokens=5, hidden=256, intermediate=300)
    small = {} if ctx.gpu else dict(heads=4, kv_heads=2)
    cases: list[tuple[str, Callable[[], Row]]] = []
    for batch_size, context in decode:
        cases.append((f"decode {batch_size}x{context}",
                      lambda b=batch_size, n=context: check_decode(c, bench, b, n, **small)))
    for name, seqs, num_decodes, sdpa in prefill:
        cases.append((f"paged {name}",
                      lambda n=name, s=seqs, d=num_decodes, q=sdpa: check_paged(c, bench, n, s, d, sdpa=q, **small)))
    mixed_decodes = sum(1 for _, chunk in variant_mixed if chunk == 1)
    for i, variant in enumerate(variants):
        cases.append((f"variant {i} decode", lambda v=variant, i=i: check_decode(
            c, bench, *variant_decode, timed=False, seed=10 + i, **v)))
        cases.append((f"variant {i} mixed", lambda v=variant, i=i: check_paged(
            c, bench, "mixed", variant_mixed, mixed_decodes, timed=False, seed=20 + i, **v)))
    # launched for a longer context than any sequence has, as the captured decode graphs are
    cases.append(("decode graph bound", lambda: check_decode(
        c, bench, *variant_decode, timed=False, seed=40, bound=4 * variant_decode[1], **small)))
    # a window shorter than every context but one, and a soft cap that bites (Gemma's rules)
    cases.append(("paged window+softcap", lambda: check_paged(
        c, bench, "mixed, window 24, softcap 2", variant_mixed, mixed_decodes, timed=False, seed=30,
        window=24, softcap=2.0, **small)))
    for tokens in write_sizes:
        cases.append((f"write_kv {tokens}", lambda t=tokens: check_write_kv(c, bench, t, **(
            {} if ctx.gpu else dict(kv_heads=2)))))
    tokens, hidden, intermediate = layer["tokens"], layer["hidden"], layer["intermediate"]
    cases.append(("rms_norm", lambda: check_rms_norm(c, bench, tokens, hidden, residual=False)))
    cases.append(("rms_norm residual", lambda: check_rms_norm(c, bench, tokens, hidden, residual=True)))
    cases.append(("rotary", lambda: check_rotary(c, bench, tokens, **({} if ctx.gpu else dict(
        heads=4, kv_heads=2, max_positions=64)))))
    cases.append(("silu_and_mul", lambda: check_silu(c, bench, tokens, intermediate)))
    cases.append(("invariant linear", lambda: check_invariant_linear(c, bench, hidden, intermediate)))
    cases.append(("lora", lambda: check_lora(c, bench, *((256, 4096, 1024) if ctx.gpu else (9, 64, 16)))))
    cases.append(("invariant attention", lambda: check_invariant_attention(
        c, "mixed", variant_mixed, mixed_decodes, head_dim=64, block_size=16,
        **(dict(kv_heads=8, group=4) if ctx.gpu else dict(kv_heads=2, group=2)))))
    return cases


# --------------------------------------------------------------------------- report


def fmt(value, spec, empty="-"):
    return empty if value is None else format(value, spec)


def print_table(ctx: Context) -> None:
    header = ["op", "case", "ok", "err/gold", "ref err", "triton us", "torch us", "sdpa us",
              "GB/s", "% peak", "% vendor", "sdpa GB/s", "TFLOP/s", "sdpa TFLOP/s", "note"]
    lines = []
    for row in ctx.rows:
        gbps = share = vendor = sdpa_gbps = tflops = sdpa_tflops = None
        if row.bytes_moved and row.triton_us:
            rate = row.bytes_moved / (row.triton_us * 1e-6)
            gbps = rate / 1e9
            share = 100 * rate / ctx.peak_copy if ctx.peak_copy else None
            vendor = 100 * rate / ctx.vendor_peak if ctx.vendor_peak else None
            if row.sdpa_us:
                sdpa_gbps = row.bytes_moved / (row.sdpa_us * 1e-6) / 1e9
        if row.flops and row.triton_us:
            tflops = row.flops / (row.triton_us * 1e-6) / 1e12
            if row.sdpa_us:
                sdpa_tflops = row.flops / (row.sdpa_us * 1e-6) / 1e12
        lines.append([
            row.op, row.case, "ok" if row.ok else "FAIL", fmt(row.error, ".1e"), fmt(row.ref_error, ".1e"),
            fmt(row.triton_us, ".1f"), fmt(row.ref_us, ".1f"), fmt(row.sdpa_us, ".1f"), fmt(gbps, ".0f"),
            fmt(share, ".0f"), fmt(vendor, ".0f"), fmt(sdpa_gbps, ".0f"), fmt(tflops, ".1f"),
            fmt(sdpa_tflops, ".1f"), row.note,
        ])
    widths = [max(len(str(x)) for x in column) for column in zip(header, *lines, strict=True)]
    for line in [header, ["-" * w for w in widths], *lines]:
        print("  ".join(str(x).ljust(w) for x, w in zip(line, widths, strict=True)).rstrip())


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run-cpu", action="store_true",
                        help="run the same checks at tiny sizes on CPU under TRITON_INTERPRET=1")
    parser.add_argument("--budget", type=float, default=270.0,
                        help="seconds after which the remaining cases are skipped (exit 3)")
    args = parser.parse_args(argv)
    started = time.monotonic()
    if args.dry_run_cpu:
        os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton
    elif os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("gpu_check: TRITON_INTERPRET is set; unset it for the GPU run (or use --dry-run-cpu)",
              file=sys.stderr)
        return EXIT_MISMATCH
    import torch

    if not args.dry_run_cpu and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here (torch.cuda.is_available() is False); run it on a "
              "CUDA machine, or use --dry-run-cpu to exercise the script under triton's interpreter",
              file=sys.stderr)
        return EXIT_NO_DEVICE
    try:
        import triton
    except ImportError:
        print("gpu_check: triton is not installed", file=sys.stderr)
        return EXIT_NO_DEVICE
    from triode import kernels

    gpu = not args.dry_run_cpu
    device = torch.device("cuda") if gpu else torch.device("cpu")
    kernels.set_backend("triton")
    ctx = Context(torch=torch, device=device, dtype=torch.bfloat16 if gpu else torch.float32, gpu=gpu,
                  deadline=started + args.budget)
    name = torch.cuda.get_device_name(device) if gpu else "CPU (triton interpreter)"
    ctx.vendor_peak = next((peak for key, peak in VENDOR_PEAK.items() if key in name), None) if gpu else None
    print(f"gpu_check: {name}; torch {torch.__version__}, triton {triton.__version__}; "
          f"working dtype {str(ctx.dtype)[6:]}")
    if gpu:
        print(f"  dispatch on cuda: {kernels.backend_for(device)}")
    bench = make_timer(ctx)
    ctx.peak_copy = measure_peak_copy(ctx, bench)
    vendor = f"; vendor peak {ctx.vendor_peak / 1e12:.2f} TB/s" if ctx.vendor_peak else ""
    print(f"  peak copy bandwidth measured: {ctx.peak_copy / 1e9:.0f} GB/s (read + write){vendor}")

    out_of_time = False
    for label, run in plan(ctx, bench):
        if time.monotonic() > ctx.deadline:
            out_of_time = True
            ctx.rows.append(Row(label, "skipped", ok=False, note="time budget exhausted"))
            continue
        case_start = time.monotonic()
        try:
            row = run()
        except Exception as error:  # report every case, fail at the end
            traceback.print_exc()
            row = Row(label, "error", ok=False, note=f"{type(error).__name__}: {error}"[:200])
        ctx.rows.append(row)
        print(f"  {'ok  ' if row.ok else 'FAIL'} {row.op}: {row.case} "
              f"({time.monotonic() - case_start:.1f}s)", flush=True)
        if gpu:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()

    print()
    print_table(ctx)
    failed = [row for row in ctx.rows if not row.ok]
    elapsed = time.monotonic() - started
    print(f"\n{len(ctx.rows) - len(failed)}/{len(ctx.rows)} cases ok in {elapsed:.0f}s")
    if any(row.case != "skipped" for row in failed):
        print("gpu_check: MISMATCH or error in: " + ", ".join(f"{r.op} {r.case}" for r in failed
                                                           if r.case != "skipped"), file=sys.stderr)
        return EXIT_MISMATCH
    if out_of_time:
        print(f"gpu_check: the {args.budget:.0f}s budget ran out before every case ran", file=sys.stderr)
        return EXIT_BUDGET
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
