"""Kernel tests: every Triton kernel run by triton's interpreter (TRITON_INTERPRET=1) on CPU
tensors against its torch reference, the dispatch, and the launchers' argument checks.

Shapes are small and tiles large enough to keep the interpreter fast, but the tiling is forced
down where it matters (decode partitions of 32 tokens, 16-token key tiles, 16-row query blocks)
so that short contexts still cross tiles, blocks and partitions. Caches are poisoned with NaN
outside every sequence's context, so a kernel that reads past a context fails loudly.
The interpreter has no bfloat16 matmul and rounds float32 -> bfloat16 toward zero, so
attention runs in float32 and float16 here and bfloat16 elementwise ops are compared within
one bfloat16 ulp; exact bfloat16 behaviour is checked on a GPU by scripts/gpu_check.py.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from triode import kernels
from triode.kernels._jit import interpreting, lazy_jit, triton_mode
from triode.kernels.decode_attention import decode_attention_reference, decode_attention_triton
from triode.kernels.kv_write import write_kv_reference, write_kv_triton
from triode.kernels.paged_attention import paged_attention_reference, paged_attention_triton
from triode.kernels.prefill_attention import prefill_attention_triton
from triode.kernels.rms_norm import rms_norm_reference, rms_norm_triton
from triode.kernels.rotary import rotary_embedding_reference, rotary_embedding_triton
from triode.kernels.silu_mul import silu_and_mul_reference, silu_and_mul_triton
from triode.kernels.testing import make_paged_batch, rope_cache, triton_interpreter

if importlib.util.find_spec("triton") is None:  # importing it here would fix its mode
    pytest.skip("triton is not installed", allow_module_level=True)

pytestmark = pytest.mark.kernels

TOLERANCE = {
    torch.float32: {"atol": 2e-5, "rtol": 1e-5},
    torch.float16: {"atol": 3e-3, "rtol": 3e-3},
    # one bfloat16 ulp: the interpreter truncates where the GPU rounds to nearest
    torch.bfloat16: {"atol": 1.6e-2, "rtol": 1.6e-2},
}
GQA_GRID = [
    pytest.param(head_dim, group, block_size, dtype,
                 id=f"d{head_dim}-g{group}-b{block_size}-{str(dtype).removeprefix('torch.')}")
    for dtype in (torch.float32, torch.float16)
    for head_dim in (64, 128)
    for group in (1, 3, 4)
    for block_size in (16, 32)
]


@pytest.fixture(autouse=True)
def _interpret():
    """TRITON_INTERPRET=1 for each test only (it does not leak into other test modules or the
    processes they start). The kernels are jitted on first launch (triode.kernels._jit); if triton
    was already imported in compile mode (torch._dynamo, which transformers imports, does
    that), triode.kernels._jit still runs them interpreted."""
    backend = kernels.get_backend()
    with triton_interpreter():
        yield
    kernels.set_backend(backend)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert not torch.isnan(actual).any(), "NaN in the kernel's output (read past a context?)"
    torch.testing.assert_close(actual.float(), expected.float(), **TOLERANCE[dtype])


# --------------------------------------------------------------------------- KV write


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_write_kv_matches_reference(head_dim, block_size, dtype):
    kv_heads, heads, tokens, num_blocks = 3, 6, 21, 5
    gen = torch.Generator().manual_seed(1)
    # key/value as the model makes them: strided views of a fused qkv projection
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    key = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    value = qkv[:, (heads + kv_heads) * head_dim:].view(tokens, kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    k_expected, v_expected = k_cache.clone(), v_cache.clone()
    write_kv_reference(key, value, k_expected, v_expected, slots)
    write_kv_triton(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, k_expected)
    assert torch.equal(v_cache, v_expected)


def test_write_kv_skips_padding_and_out_of_range_slots():
    k_cache = torch.zeros(2, 16, 1, 64)
    v_cache = torch.zeros(2, 16, 1, 64)
    key = torch.ones(3, 1, 64)
    write_kv_triton(key, key * 2, k_cache, v_cache, torch.tensor([-1, 5, 32]))
    assert k_cache.view(32, 64)[5].eq(1).all() and v_cache.view(32, 64)[5].eq(2).all()
    assert k_cache.sum() == 64 and v_cache.sum() == 128


# --------------------------------------------------------------------------- attention

# (prefix, chunk): decodes with a 1-token context, a context that is not a multiple of any
# block size and one spanning several 32-token partitions; prefill chunks without a prefix,
# with a prefix that is a multiple of the block size, with an unaligned prefix, and a
# one-token sequence.
DECODES = [(0, 1), (16, 1), (99, 1)]
PREFILLS = [(0, 23), (32, 19), (37, 6), (0, 1)]


def _decode_batch(head_dim, group, block_size, dtype, seqs=DECODES, kv_heads=2):
    return make_paged_batch(seqs, num_decodes=len(seqs), kv_heads=kv_heads, group=group,
                            head_dim=head_dim, block_size=block_size, dtype=dtype)


@pytest.mark.parametrize(("head_dim", "group", "block_size", "dtype"), GQA_GRID)
def test_decode_attention_partitions(head_dim, group, block_size, dtype):
    batch = _decode_batch(head_dim, group, block_size, dtype)
    md = batch.metadata
    k_clean, v_clean = batch.clean_caches(torch.float32)
    expected = decode_attention_reference(batch.query.float(), k_clean, v_clean, md.block_tables,
                                          md.seq_lens, md.max_seq_len, batch.scale)
    actual = decode_attention_triton(batch.query, batch.k_cache, batch.v_cache, md.block_tables,
                                     md.seq_lens, md.max_seq_len, batch.scale,
                                     partition_size=32, block_n=16)
    assert_close(actual, expected, dtype)


@pytest.mark.parametrize(
    ("partition_size", "block_n"),
    [
        pytest.param(None, None, id="default"),
        pytest.param(32, 32, id="35-partitions"),
        pytest.param(2048, 64, id="one-partition"),
    ],
)
def test_decode_attention_tilings(partition_size, block_n):
    """Default tiling, more partitions than the reduction's 32-wide chunk (1100 tokens / 32),
    and one partition (no reduction), with sequences that end in different partitions."""
    seqs = [(1099, 1), (40, 1), (0, 1), (700, 1)]
    batch = _decode_batch(64, 4, 16, torch.float32, seqs=seqs, kv_heads=1)
    md = batch.metadata
    k_clean, v_clean = batch.clean_caches()
    expected = decode_attention_reference(batch.query, k_clean, v_clean, md.block_tables,
                                          md.seq_lens, md.max_seq_len, batch.scale)
    actual = decode_attention_triton(batch.query, batch.k_cache, batch.v_cache, md.block_tables,
                                     md.seq_lens, md.max_seq_len, batch.scale,
                                     partition_size=partition_size, block_n=block_n)
    assert_close(actual, expected, torch.float32)


@pytest.mark.parametrize(("head_dim", "group", "block_size", "dtype"), GQA_GRID)
def test_paged_attention_mixed_batch(head_dim, group, block_size, dtype):
    """Decodes and prefill chunks (with cached prefixes) in one batch; the step's keys are
    written by the Triton KV write first, as the model does."""
    batch = make_paged_batch(DECODES + PREFILLS, num_decodes=len(DECODES), kv_heads=2,
                             group=group, head_dim=head_dim, block_size=block_size, dtype=dtype)
    md = batch.metadata
    flat = (-1, *batch.k_cache.shape[2:])
    batch.k_cache.view(flat)[md.slot_mapping] = float("nan")
    batch.v_cache.view(flat)[md.slot_mapping] = float("nan")
    write_kv_triton(batch.key, batch.value, batch.k_cache, batch.v_cache, md.slot_mapping)
    k_clean, v_clean = batch.clean_caches(torch.float32)
    expected = paged_attention_reference(batch.query.float(), batch.key.float(), batch.value.float(),
                                         k_clean, v_clean, md, batch.scale)
    actual = paged_attention_triton(batch.query, batch.k_cache, batch.v_cache, md, batch.scale,
                                    partition_size=32, block_n=16, block_m=16)
    assert_close(actual, expected, dtype)


@pytest.mark.parametrize(
    ("seqs", "num_decodes"),
    [
        pytest.param(PREFILLS, 0, id="prefill-only"),
        pytest.param(DECODES, 3, id="decode-only"),
        pytest.param([(5, 1), (0, 70), (130, 45)], 1, id="long-chunks"),
    ],
)
def test_paged_attention_dispatch_default_tiling(seqs, num_decodes):
    """triode.kernels.paged_attention with the backend forced to triton, default tiles."""
    batch = make_paged_batch(seqs, num_decodes=num_decodes, kv_heads=3, group=3, head_dim=64,
                             block_size=16)
    md = batch.metadata
    k_clean, v_clean = batch.clean_caches()
    expected = paged_attention_reference(batch.query, batch.key, batch.value, k_clean, v_clean,
                                         md, batch.scale)
    kernels.set_backend("triton")
    assert kernels.backend_for(batch.query.device) == "triton"
    actual = kernels.paged_attention(batch.query, batch.key, batch.value, batch.k_cache,
                                     batch.v_cache, md, batch.scale)
    assert_close(actual, expected, torch.float32)


def test_prefill_attention_strided_query_leaves_other_rows():
    """The query may be a view of a fused qkv tensor; rows of decodes are left to the decode
    kernel (untouched by the prefill launcher)."""
    batch = make_paged_batch([(9, 1), (20, 13)], num_decodes=1, kv_heads=1, group=4,
                             head_dim=64, block_size=16)
    md = batch.metadata
    tokens, heads, dim = batch.query.shape
    fused = torch.randn(tokens, (heads + 2) * dim)
    fused[:, :heads * dim] = batch.query.reshape(tokens, -1)
    query = fused[:, :heads * dim].view(tokens, heads, dim)
    assert not query.is_contiguous()
    out = torch.full_like(batch.query, 7.0)
    prefill_attention_triton(query, batch.k_cache, batch.v_cache, md.block_tables, md.seq_lens,
                             md.query_start_loc, batch.scale, first_seq=1, num_seqs=2,
                             max_query_len=13, out=out)
    k_clean, v_clean = batch.clean_caches()
    expected = paged_attention_reference(batch.query, batch.key, batch.value, k_clean, v_clean,
                                         md, batch.scale)
    assert out[0].eq(7.0).all()
    assert_close(out[1:], expected[1:], torch.float32)


# --------------------------------------------------------------------------- layer ops


def _rows(shape, dtype, strided, gen):
    """A tensor of ``shape``; strided: a view into a wider buffer (rows not contiguous)."""
    if not strided:
        return torch.randn(shape, generator=gen).to(dtype)
    wide = torch.randn((*shape[:-1], shape[-1] + 24), generator=gen).to(dtype)
    return wide[..., 8:8 + shape[-1]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize(("shape", "strided"), [((7, 100), False), ((5, 3, 64), True), ((2, 3, 2, 48), False)])
def test_rms_norm_matches_reference(shape, strided, with_residual, dtype):
    gen = torch.Generator().manual_seed(2)
    x = _rows(shape, dtype, strided, gen)
    residual = torch.randn(shape, generator=gen).to(dtype) if with_residual else None
    weight = (1 + 0.1 * torch.randn(shape[-1], generator=gen)).to(dtype)
    expected, expected_residual = rms_norm_reference(x, weight, 1e-6, residual)
    actual, actual_residual = rms_norm_triton(x, weight, 1e-6, residual)
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    assert_close(actual, expected, dtype)
    if with_residual:
        assert_close(actual_residual, expected_residual, dtype)
    else:
        assert actual_residual is None


def test_rms_norm_float32_weight_on_half_input():
    """The output dtype follows torch's promotion, as in the reference."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4, 64, generator=gen).half()
    weight = torch.randn(64, generator=gen)
    expected, _ = rms_norm_reference(x, weight, 1e-5)
    actual, _ = rms_norm_triton(x, weight, 1e-5)
    assert actual.dtype == torch.float32
    assert_close(actual, expected, torch.float16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_rotary_embedding_matches_reference(head_dim, group, dtype):
    kv_heads, tokens = 2, 9
    heads = kv_heads * group
    gen = torch.Generator().manual_seed(4)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    query = qkv[:, :heads * head_dim].view(tokens, heads, head_dim)
    key = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    positions = torch.randint(0, 300, (tokens,), generator=gen)
    if group == 3:
        positions = positions.int()
    cache = rope_cache(300, head_dim)
    expected_q, expected_k = query.clone(), key.clone()
    rotary_embedding_reference(positions.long(), expected_q, expected_k, cache)
    untouched = qkv[:, (heads + kv_heads) * head_dim:].clone()
    rotary_embedding_triton(positions, query, key, cache)
    assert_close(query, expected_q, dtype)
    assert_close(key, expected_k, dtype)
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim:], untouched)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("shape", "strided"), [((5, 128), False), ((3, 200), True), ((2, 2, 2600), False)])
def test_silu_and_mul_matches_reference(shape, strided, dtype):
    gen = torch.Generator().manual_seed(5)
    x = _rows(shape, dtype, strided, gen)
    expected = silu_and_mul_reference(x)
    actual = silu_and_mul_triton(x)
    assert actual.shape == expected.shape
    assert_close(actual, expected, dtype)


def test_dispatch_routes_every_op_to_triton():
    """The model-facing API with TRIODE_KERNELS=triton semantics on CPU tensors."""
    gen = torch.Generator().manual_seed(6)
    kernels.set_backend("triton")
    x = torch.randn(4, 64, generator=gen)
    residual = torch.randn(4, 64, generator=gen)
    weight = torch.randn(64, generator=gen)
    out, new_residual = kernels.rms_norm(x, weight, 1e-6, residual)
    expected, expected_residual = rms_norm_reference(x, weight, 1e-6, residual)
    assert_close(out, expected, torch.float32)
    assert_close(new_residual, expected_residual, torch.float32)
    gate_up = torch.randn(4, 96, generator=gen)
    assert_close(kernels.silu_and_mul(gate_up), silu_and_mul_reference(gate_up), torch.float32)
    query, key = torch.randn(4, 4, 64, generator=gen), torch.randn(4, 2, 64, generator=gen)
    positions = torch.tensor([0, 1, 2, 50])
    cache = rope_cache(64, 64)
    expected_q, expected_k = query.clone(), key.clone()
    rotary_embedding_reference(positions, expected_q, expected_k, cache)
    kernels.rotary_embedding(positions, query, key, cache)
    assert_close(query, expected_q, torch.float32)
    assert_close(key, expected_k, torch.float32)
    k_cache, v_cache = torch.zeros(2, 16, 2, 64), torch.zeros(2, 16, 2, 64)
    kernels.write_kv(key, key + 1, k_cache, v_cache, torch.tensor([3, 4, 17, 30]))
    assert torch.equal(k_cache.view(32, 2, 64)[[3, 4, 17, 30]], key)
    kernels.set_backend("torch")
    assert kernels.backend_for(torch.device("cpu")) == "torch"


# --------------------------------------------------------------------------- lazy triton


def test_import_kernels_without_triton():
    """``import triode.kernels`` never imports triton, and the references work where it is missing."""
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'triton' or name.startswith('triton.'):\n"
        "            raise ImportError('no triton here')\n"
        "sys.meta_path.insert(0, Block())\n"
        "import torch\n"
        "from triode import kernels\n"
        "assert kernels.backend_for(torch.device('cuda')) == 'torch'\n"
        "x = torch.randn(3, 8)\n"
        "out, _ = kernels.rms_norm(x, torch.ones(8), 1e-6)\n"
        "assert kernels.silu_and_mul(x).shape == (3, 4)\n"
        "assert 'triton' not in sys.modules\n"
        "print('ok')\n"
    )
    env = {**os.environ, "TRIODE_KERNELS": "auto"}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                            timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_lazy_jit_mode(monkeypatch):
    """Kernels are jitted on first launch, in the mode TRITON_INTERPRET asks for then."""
    from triode.kernels.silu_mul import _silu_and_mul_kernel

    assert interpreting() and triton_mode() is not None
    interpreted = _silu_and_mul_kernel.jitted()
    assert type(interpreted).__name__ == "InterpretedFunction"
    assert _silu_and_mul_kernel.jitted() is interpreted
    if triton_mode() == "interpret":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        with pytest.raises(RuntimeError, match="unset TRITON_INTERPRET before anything imports triton"):
            _silu_and_mul_kernel.jitted()
    kernel = lazy_jit(do_not_specialize=["x"])(test_lazy_jit_mode)
    assert kernel.jit_kwargs == {"do_not_specialize": ["x"]} and kernel._jitted is None


def test_interpreter_after_triton_was_imported_in_compile_mode():
    """torch._dynamo (imported by transformers) imports triton; the interpreted kernels must
    still run then, and leave triton's standard library as they found it."""
    code = (
        "import os, sys, torch\n"
        "os.environ.pop('TRITON_INTERPRET', None)\n"
        "import triton, triton.language as tl\n"
        "zeros = tl.zeros\n"
        "from triode.kernels._jit import triton_mode\n"
        "from triode.kernels.testing import triton_interpreter\n"
        "from triode.kernels.rms_norm import rms_norm_reference, rms_norm_triton\n"
        "assert triton_mode() == 'compile'\n"
        "x, w = torch.randn(3, 40), torch.randn(40)\n"
        "with triton_interpreter():\n"
        "    out, _ = rms_norm_triton(x, w, 1e-6)\n"
        "torch.testing.assert_close(out, rms_norm_reference(x, w, 1e-6)[0])\n"
        "assert tl.zeros is zeros and type(zeros).__name__ == 'JITFunction'\n"
        "print('ok')\n"
    )
    env = dict(os.environ)
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                            timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def _bundled_ptxas() -> bool:
    spec = importlib.util.find_spec("triton")
    locations = spec.submodule_search_locations if spec else None
    return bool(os.environ.get("TRITON_PTXAS_PATH")) or any(
        (Path(location) / "backends" / "nvidia" / "bin" / "ptxas").exists() for location in locations or ()
    )


@pytest.mark.skipif(not _bundled_ptxas(), reason="triton has no ptxas here to compile for CUDA")
def test_kernels_compile_for_hopper():
    """The interpreter never runs triton's compiler: compile every kernel for sm_90 (no GPU
    needed) in a fresh process, in compile mode, to catch what only the compiler rejects."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-m", "triode.kernels.compile_check", "--arch", "90"], env=env,
                            capture_output=True, text=True, timeout=170, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("ok ") == 16, result.stdout


# --------------------------------------------------------------------------- bad input


def _kv_args(**change):
    args = {
        "key": torch.zeros(4, 2, 64),
        "value": torch.zeros(4, 2, 64),
        "k_cache": torch.zeros(3, 16, 2, 64),
        "v_cache": torch.zeros(3, 16, 2, 64),
        "slot_mapping": torch.arange(4),
    }
    args.update(change)
    return args


def _decode_args(**change):
    args = {
        "query": torch.zeros(2, 4, 64),
        "k_cache": torch.zeros(3, 16, 2, 64),
        "v_cache": torch.zeros(3, 16, 2, 64),
        "block_tables": torch.zeros(2, 3, dtype=torch.int32),
        "seq_lens": torch.ones(2, dtype=torch.int32),
        "max_seq_len": 1,
        "scale": 0.125,
    }
    args.update(change)
    return args


def _qkv_strided(shape):
    """A tensor of ``shape`` whose last dimension is not contiguous."""
    return torch.zeros(tuple(reversed(shape))).transpose(0, -1)


BAD_INPUTS = [
    # KV write
    ("write_kv", _kv_args(key=torch.zeros(4, 2, 64, dtype=torch.float16)), "key"),
    ("write_kv", _kv_args(key=torch.zeros(4, 3, 64), value=torch.zeros(4, 3, 64)), "key"),
    ("write_kv", _kv_args(value=torch.zeros(5, 2, 64)), "value"),
    ("write_kv", _kv_args(value=_qkv_strided((4, 2, 64))), "value"),
    ("write_kv", _kv_args(slot_mapping=torch.arange(4, dtype=torch.int32)), "slot_mapping"),
    ("write_kv", _kv_args(slot_mapping=torch.arange(8)[::2]), "slot_mapping"),
    ("write_kv", _kv_args(k_cache=torch.zeros(3, 2, 16, 64).transpose(1, 2)), "k_cache"),
    ("write_kv", _kv_args(v_cache=torch.zeros(3, 16, 2, 64, device="meta")), "v_cache"),
    ("write_kv", _kv_args(key=torch.zeros(4, 2, 64, device="meta"), value=torch.zeros(4, 2, 64, device="meta"),
                          k_cache=torch.zeros(3, 16, 2, 64, device="meta"),
                          v_cache=torch.zeros(3, 16, 2, 64, device="meta"),
                          slot_mapping=torch.arange(4, device="meta")), "key"),
    # decode attention
    ("decode", _decode_args(query=torch.zeros(2, 4, 64, dtype=torch.float16)), "query"),
    ("decode", _decode_args(query=torch.zeros(2, 3, 64)), "query"),
    ("decode", _decode_args(query=_qkv_strided((2, 4, 64))), "query"),
    ("decode", _decode_args(block_tables=torch.zeros(2, 3, dtype=torch.int64)), "block_tables"),
    ("decode", _decode_args(block_tables=torch.zeros(1, 3, dtype=torch.int32)), "block_tables"),
    ("decode", _decode_args(seq_lens=torch.ones(4, dtype=torch.int32)[::2]), "seq_lens"),
    ("decode", _decode_args(max_seq_len=49), "max_seq_len"),
    ("decode", _decode_args(k_cache=torch.zeros(3, 16, 2, 32)), "v_cache"),
    ("decode", _decode_args(partition_size=40), "partition_size"),
    ("decode", _decode_args(block_n=24), "block_n"),
    # layer ops
    ("rms_norm", {"x": torch.zeros(3, 8, dtype=torch.int32), "weight": torch.ones(8), "eps": 1e-6}, "x"),
    ("rms_norm", {"x": torch.zeros(8), "weight": torch.ones(8), "eps": 1e-6}, "x"),
    ("rms_norm", {"x": _qkv_strided((3, 8)), "weight": torch.ones(8), "eps": 1e-6}, "x"),
    ("rms_norm", {"x": torch.zeros(3, 8), "weight": torch.ones(9), "eps": 1e-6}, "weight"),
    ("rms_norm", {"x": torch.zeros(3, 8), "weight": torch.ones(8), "eps": 1e-6,
                  "residual": torch.zeros(3, 8, dtype=torch.float16)}, "residual"),
    ("rms_norm", {"x": torch.zeros(3, 8), "weight": torch.ones(8), "eps": -1.0}, "eps"),
    ("rms_norm", {"x": torch.zeros(3, 8, device="meta"), "weight": torch.ones(8, device="meta"),
                  "eps": 1e-6}, "x"),
    ("rotary", {"positions": torch.zeros(2), "query": torch.zeros(2, 4, 64), "key": torch.zeros(2, 2, 64),
                "cos_sin_cache": torch.zeros(8, 64)}, "positions"),
    ("rotary", {"positions": torch.zeros(2, dtype=torch.long), "query": torch.zeros(2, 4, 64),
                "key": torch.zeros(2, 2, 32), "cos_sin_cache": torch.zeros(8, 64)}, "key"),
    ("rotary", {"positions": torch.zeros(2, dtype=torch.long), "query": torch.zeros(2, 4, 64),
                "key": torch.zeros(2, 2, 64), "cos_sin_cache": torch.zeros(8, 32)}, "cos_sin_cache"),
    ("rotary", {"positions": torch.zeros(2, dtype=torch.long), "query": torch.zeros(2, 256),
                "key": torch.zeros(2, 2, 64), "cos_sin_cache": torch.zeros(8, 64)}, "query"),
    ("silu", {"x": torch.zeros(3, 7)}, "x"),
    ("silu", {"x": torch.zeros(3, 8, dtype=torch.int64)}, "x"),
    ("silu", {"x": _qkv_strided((3, 8))}, "x"),
]
LAUNCHERS = {
    "write_kv": write_kv_triton,
    "decode": decode_attention_triton,
    "rms_norm": rms_norm_triton,
    "rotary": rotary_embedding_triton,
    "silu": silu_and_mul_triton,
}


@pytest.mark.parametrize(("op", "args", "name"), BAD_INPUTS,
                         ids=[f"{op}-{i}-{name}" for i, (op, _, name) in enumerate(BAD_INPUTS)])
def test_launchers_reject_bad_input(op, args, name):
    with pytest.raises(ValueError, match=rf"^{name}: "):
        LAUNCHERS[op](**args)


def test_paged_attention_rejects_inconsistent_metadata():
    batch = make_paged_batch([(3, 1), (4, 6)], num_decodes=1, kv_heads=1, group=2, head_dim=64,
                             block_size=16)
    md = batch.metadata
    args = (batch.k_cache, batch.v_cache)

    def call(query=batch.query, **change):
        fields = {name: getattr(md, name) for name in md.__dataclass_fields__}
        fields.update(change)
        return paged_attention_triton(query, *args, type(md)(**fields), batch.scale)

    with pytest.raises(ValueError, match=r"^num_decodes: "):
        call(num_decodes=2)
    with pytest.raises(ValueError, match=r"^seq_lens: "):
        call(seq_lens_host=(4, 5))
    with pytest.raises(ValueError, match=r"^query_start_loc: "):
        call(query_start_loc=md.query_start_loc.long())
    with pytest.raises(ValueError, match=r"^query: "):
        call(query=batch.query[:, :, :32])
    with pytest.raises(ValueError, match=r"^block_tables: "):
        call(block_tables=md.block_tables[:1])
    with pytest.raises(ValueError, match=r"^query_start_loc: "):
        prefill_attention_triton(batch.query, *args, md.block_tables, md.seq_lens,
                                 md.query_start_loc[:2], batch.scale, first_seq=1, num_seqs=2,
                                 max_query_len=6)


def test_device_metadata_past_the_host_copies_stays_in_bounds():
    """The device copies of seq_lens/query_start_loc cannot be checked without a sync; if they
    disagree with the checked host copies, the kernels clamp instead of reading out of bounds."""
    batch = make_paged_batch([(30, 1), (20, 12)], num_decodes=1, kv_heads=1, group=2, head_dim=64,
                             block_size=16, poison=False)
    md = batch.metadata
    fields = {name: getattr(md, name) for name in md.__dataclass_fields__}
    fields["seq_lens"] = md.seq_lens + 1000
    fields["query_start_loc"] = md.query_start_loc + torch.tensor([0, 0, 50], dtype=torch.int32)
    out = paged_attention_triton(batch.query, batch.k_cache, batch.v_cache, type(md)(**fields),
                                 batch.scale, partition_size=32, block_n=16)
    assert out.shape == batch.query.shape and not torch.isnan(out).any()


def test_cpu_tensors_need_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match=r"^x: .*TRITON_INTERPRET=1"):
        silu_and_mul_triton(torch.zeros(2, 8))
    with pytest.raises(ValueError, match=r"^k_cache: .*CUDA"):
        decode_attention_triton(**_decode_args())
