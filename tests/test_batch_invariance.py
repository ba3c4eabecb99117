"""Kernels: batch invariance. A token's result is the same bits whatever else its step holds:
computed alone, inside batches of 2, 7, 64 and 300 rows, or (attention) as a decode or as a
row of a prefill chunk of any size. That is what makes a request recomputed after a worker
restart or a preemption, or resumed from the prefix cache, produce the tokens and logprobs
it would have had (docs/architecture.md, "Batch invariance"). Each reduction is checked on
every path that runs it: this CPU's build of the C kernels and the AVX2 one, the torch
references and the Triton kernels (under triton's interpreter). Attention and the row-wise ops
of the C kernels are invariant as they are; linear layers (but interleaved quantized weights),
the experts and the other paths with ``set_batch_invariant(True)`` (``--batch-invariant``),
which their fastest kernels are not (docs/architecture.md)."""

from __future__ import annotations

import contextlib
import importlib.util

import numpy as np
import pytest
import torch

from tests.test_quant_linear import random_blocks
from triode import kernels
from triode.kernels import native
from triode.kernels.cpu_attention import cpu_decode_available
from triode.kernels.invariance import batch_invariant, set_batch_invariant
from triode.kernels.metadata import AttentionMetadata
from triode.kernels.quant_linear import (
    QuantizedWeight,
    interleaved_kernels_available,
    quantized_activations,
    quantized_kernels_available,
    set_quantized_activations,
)
from triode.kernels.testing import triton_interpreter

BATCHES = (2, 7, 64, 300)


@pytest.fixture(params=["native", "avx2", "torch", "triton"])
def path(request):
    """The kernels that run the op: this CPU's build of the C kernels, the AVX2 one
    (TRIODE_CPU_ISA=avx2), the torch references or the Triton kernels under the interpreter;
    the last two with set_batch_invariant(True), as a worker sets it."""
    name, backend, isa = request.param, kernels.get_backend(), native.cpu_isa()
    if name in ("native", "avx2") and not cpu_decode_available():
        pytest.skip("no C compiler to build the kernels")
    if name == "triton" and importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    with contextlib.ExitStack() as stack:
        if name in ("native", "avx2"):
            native.set_cpu_isa(name)
        else:
            kernels.set_backend(name)
            stack.enter_context(invariant_setting(True))
        if name == "triton":
            stack.enter_context(triton_interpreter())
        try:
            yield name
        finally:
            kernels.set_backend(backend)
            native.set_cpu_isa(isa)


@contextlib.contextmanager
def invariant_setting(on: bool):
    previous = batch_invariant()
    set_batch_invariant(on)
    try:
        yield
    finally:
        set_batch_invariant(previous)


def _in_batch(row: torch.Tensor, size: int, seed: int) -> tuple[torch.Tensor, int]:
    """``row`` placed at a random index among ``size - 1`` random rows: (batch, index)."""
    generator = torch.Generator().manual_seed(seed)
    batch = torch.randn((size, *row.shape), generator=generator).to(row.dtype)
    index = int(torch.randint(size, (1,), generator=generator))
    batch[index] = row
    return batch, index


# --------------------------------------------------------------------------- attention

BLOCK, KV_HEADS, GROUP, DIM = 16, 3, 3, 64
TARGET_LEN = 70  # the target sequence's tokens: 4 blocks and a part


class Cache:
    """A paged cache holding one target sequence (its keys, values and per-position queries
    fixed) and room for filler sequences of random content."""

    def __init__(self, dtype: torch.dtype, blocks: int = 2400) -> None:
        generator = torch.Generator().manual_seed(0)
        shape = (blocks, BLOCK, KV_HEADS, DIM)
        self.k = torch.randn(shape, generator=generator).to(dtype)
        self.v = torch.randn(shape, generator=generator).to(dtype)
        self.queries = torch.randn((TARGET_LEN, KV_HEADS * GROUP, DIM), generator=generator).to(dtype)
        self.target_blocks = torch.randperm(blocks, generator=generator)[: -(-TARGET_LEN // BLOCK)]
        self.free = [b for b in range(blocks) if b not in set(self.target_blocks.tolist())]
        self.generator = generator

    def filler(self, length: int) -> list[int]:
        count = -(-length // BLOCK)
        taken, self.free = self.free[:count], self.free[count:]
        return taken


def _step(cache: Cache, decodes: list[int], chunks: list[int], target: tuple[int, int]) -> tuple[torch.Tensor, int]:
    """Attention of one step: filler decodes of the given context lengths, then filler prefill
    chunks of the given sizes (no cached prefix), with the target sequence's tokens
    [start, end) inserted as a decode (end - start == 1, placed first) or as the last chunk.
    Returns (the step's output, the row of the target's last token)."""
    start, end = target
    # (block table, context length, query tokens) per sequence, decodes first
    seqs = [(cache.filler(n), n, 1) for n in decodes] + [(cache.filler(n), n, n) for n in chunks]
    at = 0 if end - start == 1 else len(seqs)
    seqs.insert(at, (cache.target_blocks.tolist(), end, end - start))
    tables, lengths, query_lens = (list(column) for column in zip(*seqs, strict=True))
    starts = np.concatenate([[0], np.cumsum(query_lens)]).tolist()
    width = max(len(t) for t in tables)
    table_tensor = torch.zeros((len(tables), width), dtype=torch.int32)
    for i, table in enumerate(tables):
        table_tensor[i, : len(table)] = torch.tensor(table, dtype=torch.int32)
    query = torch.randn((starts[-1], KV_HEADS * GROUP, DIM), generator=cache.generator).to(cache.k.dtype)
    query[starts[at]: starts[at + 1]] = cache.queries[start:end]
    metadata = AttentionMetadata(
        slot_mapping=torch.zeros(starts[-1], dtype=torch.int64),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(lengths, dtype=torch.int32), block_tables=table_tensor,
        num_decodes=len(decodes) + (at == 0 and end - start == 1), max_query_len=max(query_lens),
        max_seq_len=max(lengths), query_start_loc_host=tuple(starts), seq_lens_host=tuple(lengths),
    )
    # The step's own keys are already in the cache (the CPU path reads only the cache).
    key = value = torch.empty((starts[-1], KV_HEADS, DIM), dtype=cache.k.dtype)
    out = kernels.paged_attention(query, key, value, cache.k, cache.v, metadata, DIM ** -0.5)
    return out, starts[at + 1] - 1


def _target_attention(cache: Cache, position: int) -> torch.Tensor:
    """The target's token at ``position`` attending to its keys up to itself, in float64."""
    slots = torch.arange(position + 1)
    blocks = cache.target_blocks[slots // BLOCK]
    keys = cache.k[blocks, slots % BLOCK].double().repeat_interleave(GROUP, dim=1)  # [len, heads, dim]
    values = cache.v[blocks, slots % BLOCK].double().repeat_interleave(GROUP, dim=1)
    scores = torch.einsum("hd,lhd->hl", cache.queries[position].double(), keys) * DIM ** -0.5
    return torch.einsum("hl,lhd->hd", scores.softmax(dim=-1), values)


def _interpretable(path: str, dtype: torch.dtype) -> torch.dtype:
    """triton's interpreter has no bfloat16 matmul (tests/test_kernels.py): float16 there."""
    return torch.float16 if path == "triton" and dtype == torch.bfloat16 else dtype


def _attention_in_steps(path: str, dtype: torch.dtype, batches: tuple[int, ...], chunks: tuple[int, ...],
                        other_chunks: tuple[int, ...] = (7, 20)) -> int:
    """The target's last token as a decode alone, among ``batches`` of decodes, and as the last
    row of prefill chunks of the sizes ``chunks`` beside decodes and ``other_chunks``: the same
    bits each time. Returns the number of steps compared."""
    cache = Cache(_interpretable(path, dtype))
    alone, row = _step(cache, [], [], (TARGET_LEN - 1, TARGET_LEN))
    expected = alone[row]
    torch.testing.assert_close(expected.double(), _target_attention(cache, TARGET_LEN - 1), atol=2e-2, rtol=2e-2)
    seen = 0
    for size in batches:
        lengths = torch.randint(1, 200, (size - 1,), generator=cache.generator).tolist()
        out, row = _step(cache, lengths, [], (TARGET_LEN - 1, TARGET_LEN))
        assert torch.equal(out[row], expected), f"a decode among {size}"
        seen += 1
    for chunk in chunks:
        for neighbours in ([], [3, 40], [1] * 6):
            out, row = _step(cache, neighbours, list(other_chunks), (TARGET_LEN - chunk, TARGET_LEN))
            assert torch.equal(out[row], expected), f"the last row of a {chunk}-token chunk beside {neighbours}"
            seen += 1
    return seen


CHUNKS = (2, 5, 16, 33, TARGET_LEN)


@pytest.mark.parametrize(("path", "dtype"), [
    *((path, dtype) for path in ("native", "avx2", "torch") for dtype in (torch.float32, torch.bfloat16)),
    ("triton", torch.float32),
    pytest.param("triton", torch.bfloat16, marks=pytest.mark.slow),
], indirect=["path"])
def test_attention_of_a_token_is_the_same_in_any_step(path, dtype):
    if path == "triton":  # the interpreter runs one program at a time: the large steps are slow cases
        steps = _attention_in_steps(path, dtype, BATCHES[:2], (2, 16), other_chunks=(3,))
        assert steps == 2 + 3 * 2
    else:
        assert _attention_in_steps(path, dtype, BATCHES, CHUNKS) == len(BATCHES) + 3 * len(CHUNKS)


@pytest.mark.slow
@pytest.mark.parametrize("path", ["triton"], indirect=True)
def test_triton_attention_of_a_token_is_the_same_in_large_steps(path):
    assert _attention_in_steps(path, torch.float32, BATCHES[2:], CHUNKS) == 2 + 3 * len(CHUNKS)


def test_every_row_of_a_prefill_is_its_decode(path):
    """Each token of a one-shot prefill gets the bits of the decode at its position."""
    cache = Cache(torch.float32)
    whole, _ = _step(cache, [5], [], (0, TARGET_LEN))
    first = 1  # the filler decode comes first
    for position in range(0, TARGET_LEN, 7 if path == "triton" else 1):
        decode, row = _step(cache, [], [], (position, position + 1))
        assert torch.equal(whole[first + position], decode[row]), f"position {position}"


# --------------------------------------------------------------------------- per-row ops

ROW_OPS = {
    "rms_norm": lambda x: kernels.rms_norm(x, torch.linspace(0.5, 1.5, x.shape[1]), 1e-6)[0],
    "rms_norm_residual": lambda x: torch.cat(kernels.rms_norm(x, torch.linspace(0.5, 1.5, x.shape[1]), 1e-6,
                                                              x.flip(1).clone()), dim=1),
    "silu_and_mul": kernels.silu_and_mul,
    "argmax": lambda x: kernels.argmax(x.round(decimals=1)),  # ties, broken the same way in any batch
}


@pytest.mark.parametrize("op", sorted(ROW_OPS))
def test_row_wise_ops_are_the_same_in_any_batch(path, op):
    row = torch.randn(576 * 4, generator=torch.Generator().manual_seed(1))
    compute = ROW_OPS[op]
    expected = compute(row[None].clone())[0]
    for size in BATCHES:
        batch, index = _in_batch(row, size, seed=size)
        assert torch.equal(compute(batch)[index], expected), f"among {size} rows"


def test_rotary_is_the_same_in_any_batch(path):
    heads, kv_heads, dim = 9, 3, 64
    generator = torch.Generator().manual_seed(2)
    cos_sin = torch.randn((4096, dim), generator=generator)
    query, key = torch.randn((1, heads, dim), generator=generator), torch.randn((1, kv_heads, dim), generator=generator)
    expected_q, expected_k = query.clone(), key.clone()
    kernels.rotary_embedding(torch.tensor([1234]), expected_q, expected_k, cos_sin)
    for size in BATCHES:
        queries, index = _in_batch(query[0], size, seed=size)
        keys, _ = _in_batch(key[0], size, seed=size)
        keys[index] = key[0]
        positions = torch.randint(0, 4096, (size,), generator=generator)
        positions[index] = 1234
        kernels.rotary_embedding(positions, queries, keys, cos_sin)
        assert torch.equal(queries[index], expected_q[0]) and torch.equal(keys[index], expected_k[0])


# --------------------------------------------------------------------------- quantized linear


@pytest.fixture
def activations(request):
    previous = quantized_activations()
    set_quantized_activations(request.param)
    yield request.param
    set_quantized_activations(previous)


def _linear_in_batches(weight: QuantizedWeight, in_features: int) -> int:
    row = torch.randn(in_features, generator=torch.Generator().manual_seed(4))
    expected = weight.linear(row[None])[0]
    checked = 0
    for size in BATCHES:
        batch, index = _in_batch(row, size, seed=size)
        assert torch.equal(weight.linear(batch)[index], expected), f"among {size} rows"
        checked += 1
    return checked


@pytest.mark.skipif(not interleaved_kernels_available(), reason="this CPU has no interleaved kernels (AVX2 and a C compiler)")
@pytest.mark.parametrize("activations", ["int8", "int16"], indirect=True)
@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0", "Q4_K", "Q6_K"])
def test_interleaved_linear_is_the_same_in_any_batch(kind, activations):
    weight = QuantizedWeight.from_bytes(kind, torch.from_numpy(random_blocks(kind, 96, 512, seed=3))).interleave()
    assert _linear_in_batches(weight, 512) == len(BATCHES)


@pytest.fixture
def invariant():
    with invariant_setting(True):
        yield


@pytest.mark.skipif(not quantized_kernels_available(), reason="no quantized kernels (AVX2 and a C compiler)")
@pytest.mark.parametrize("activations", ["float32"], indirect=True)
@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"])
def test_gguf_layout_linear_is_the_same_in_any_batch_when_invariant(activations, isa, kind, invariant):
    """Weights in GGUF's layout (float32 activations: the default where there are no
    interleaved kernels) under set_batch_invariant: the C loop at every row count, past
    FUSED_ROWS too."""
    weight = QuantizedWeight.from_bytes(kind, torch.from_numpy(random_blocks(kind, 96, 512, seed=3)))
    assert _linear_in_batches(weight, 512) == len(BATCHES)


@pytest.mark.skipif(not quantized_kernels_available(), reason="no quantized kernels (AVX2 and a C compiler)")
@pytest.mark.parametrize("activations", ["int8"], indirect=True)
def test_int8_activations_over_gguf_layout_are_refused_when_invariant(activations, invariant):
    weight = QuantizedWeight.from_bytes("Q4_0", torch.from_numpy(random_blocks("Q4_0", 96, 512, seed=3)))
    with pytest.raises(RuntimeError, match="int8 activations over weights in GGUF's layout have no batch-invariant"):
        weight.linear(torch.randn(2, 512))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_float_linear_is_the_same_in_any_batch_when_invariant(path, dtype):
    """Float weights under --batch-invariant: the C loop's tiles at every row count (oneDNN,
    MKL and the few-row loop otherwise each sum in their own order), the fixed-tile Triton
    matmul, or torch one row at a time."""
    dtype = _interpretable(path, dtype)
    generator = torch.Generator().manual_seed(5)
    weight, bias = torch.randn((200, 576), generator=generator).to(dtype), torch.randn(200, generator=generator).to(dtype)
    row = torch.randn(576, generator=generator).to(dtype)
    with invariant_setting(True):
        expected = kernels.linear(row[None], weight, bias)[0]
        torch.testing.assert_close(expected.float(), (row.float() @ weight.float().T + bias.float()),
                                   rtol=2e-2, atol=2e-2)
        for size in BATCHES:
            batch, index = _in_batch(row, size, seed=size)
            assert torch.equal(kernels.linear(batch, weight, bias)[index], expected), f"among {size} rows"


def test_experts_of_a_token_are_the_same_in_any_batch_when_invariant(path):
    """A mixture-of-experts layer: each expert's matmul over however many tokens chose it, and
    the token's weighted sum over its experts, in one order."""
    num_experts, top_k, hidden, intermediate = 8, 2, 64, 96
    generator = torch.Generator().manual_seed(6)
    w_gate_up = torch.randn((num_experts, 2 * intermediate, hidden), generator=generator) * 0.2
    w_down = torch.randn((num_experts, hidden, intermediate), generator=generator) * 0.2
    row = torch.randn(hidden, generator=generator)
    router = torch.randn((num_experts, hidden), generator=generator)

    def experts(x):
        weights, chosen = kernels.route_experts(kernels.linear(x, router), top_k, normalize=True)
        return kernels.fused_experts(x, weights, chosen, w_gate_up, w_down)

    with invariant_setting(True):
        expected = experts(row[None])[0]
        for size in BATCHES:
            batch, index = _in_batch(row, size, seed=size)
            assert torch.equal(experts(batch)[index], expected), f"among {size} tokens"
