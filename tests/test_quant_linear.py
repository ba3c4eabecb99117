"""kernels: the quantized CPU kernels (triode.kernels.quant_linear, csrc/quant_linear.c) against the
gguf package's own dequantization followed by a float64 matmul.

Blocks are random, written into a GGUF file by the ``gguf`` package's writer and read back by
its reader, so the kernels read exactly the bytes a real file holds. Every type runs at 1, 2,
8, 64 and 512 rows (the C loop and the dequantized-panel path both), on odd output sizes,
with this CPU's widest vectors and with the AVX2 build (``TRIODE_CPU_ISA=avx2``).

The int8-activation loop (csrc/quant_linear_int8.c) is held to the same reference exactly on
rows that int8 represents without loss (integers times a power of two per 32 values, or per
256 for the K types, each 32 reaching 127), which checks its integer arithmetic bit for bit,
and within the quantization error of the activations on random rows. Weights interleaved 16
rows at a time (csrc/quant_x16.h) are held to the same reference and to the same matrix in
GGUF's layout: the same rows back, the same integer sums; in both builds, which must give the
same bits.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

from triode.engine.model_files.gguf_convert import KERNEL_TYPES
from triode.kernels import native
from triode.kernels.quant_linear import (
    FUSED_ROWS,
    QUANT_TYPES,
    QuantizedWeight,
    interleaved_kernels_available,
    interleaving,
    quantized_activations,
    quantized_kernels_available,
    set_quantized_activations,
)

pytestmark = pytest.mark.skipif(not quantized_kernels_available(), reason="no AVX2 or no C compiler")

# Offsets of the float16 scales in each block (the rest of a block is any bits at all).
_HALF_OFFSETS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
# float32 sums in another order than the float64 reference: error relative to the largest
# output, per type (measured at most 4e-7; the K types' larger blocks sum more terms).
TOLERANCE = {"Q4_0": 2e-6, "Q4_1": 2e-6, "Q8_0": 2e-6, "Q4_K": 5e-6, "Q5_K": 5e-6, "Q6_K": 5e-6}


def cpu_flags() -> set[str]:
    """This CPU's instruction-set flags, as /proc/cpuinfo names them."""
    return set(next(line for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("flags")).split())


def random_blocks(kind: str, rows: int, columns: int, seed: int) -> np.ndarray:
    """uint8 [rows, bytes]: random quantized values with finite, moderate float16 scales."""
    _, weights, size = QUANT_TYPES[kind]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows, columns // weights, size), dtype=np.uint8)
    for offset in _HALF_OFFSETS[kind]:
        halves = (rng.standard_normal(blocks.shape[:2]) * 0.02).astype(np.float16)
        blocks[:, :, offset:offset + 2] = halves.view(np.uint8).reshape(*blocks.shape[:2], 2)
    return blocks.reshape(rows, -1)


def through_a_gguf_file(path, kind: str, blocks: np.ndarray) -> np.ndarray:
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tensor("weight", blocks, raw_dtype=T[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    (tensor,) = gguf.GGUFReader(path).tensors
    assert tensor.tensor_type == T[kind]
    return np.array(tensor.data)


@pytest.fixture
def int8_activations():
    previous = quantized_activations()
    set_quantized_activations("int8")
    yield
    set_quantized_activations(previous)


@pytest.fixture
def int16_activations():
    previous = quantized_activations()
    set_quantized_activations("int16")
    yield
    set_quantized_activations(previous)


def representable_rows(rows: int, columns: int, span: int, seed: int) -> torch.Tensor:
    """Rows that the int8 activations hold exactly: integers in [-127, 127] with a 127 in every
    32, times a power of two per ``span`` values (the kernels' scale: 32, or 256 for K types)."""
    rng = np.random.default_rng(seed)
    values = rng.integers(-127, 128, size=(rows, columns // 32, 32))
    values[:, :, 0] = 127 * rng.choice([-1, 1], size=(rows, columns // 32))
    scales = np.repeat(2.0 ** rng.integers(-8, 2, size=(rows, columns // span)), span // 32, axis=1)
    return torch.from_numpy((values * scales[..., None]).reshape(rows, columns).astype(np.float32))


@pytest.mark.parametrize("kind", sorted(QUANT_TYPES))
def test_int8_activations_compute_exactly_what_they_hold(kind, isa, int8_activations, tmp_path):
    weights = QUANT_TYPES[kind][1]
    in_features = 3 * weights if weights == 256 else 7 * weights  # an odd count of groups
    blocks = through_a_gguf_file(tmp_path / "w.gguf", kind, random_blocks(kind, 37, in_features, 6))
    weight = QuantizedWeight.from_bytes(kind, torch.from_numpy(blocks))
    reference_weight = torch.from_numpy(dequantize(blocks, T[kind])).double()
    bias = torch.randn(37)
    for rows in (1, 2, 3, 4, 5, 13):
        x = representable_rows(rows, in_features, weights, rows)
        expected = x.double() @ reference_weight.T + bias.double()
        got = weight.linear(x, bias)
        scale = expected.abs().max().item()
        assert (got.double() - expected).abs().max().item() <= 4 * TOLERANCE[kind] * scale, (kind, rows)


@pytest.mark.parametrize("kind", sorted(QUANT_TYPES))
def test_int8_activations_stay_within_their_rounding(kind, int8_activations, tmp_path):
    """Random rows: each activation moves by at most half its step (max |x| / 254 over its 32,
    or its 256 for K types), and the result is the weights times the moved activations, so
    each output moves by at most sum(|w| * step)."""
    weights = QUANT_TYPES[kind][1]
    blocks = through_a_gguf_file(tmp_path / "w.gguf", kind, random_blocks(kind, 64, 2 * weights, 7))
    weight = QuantizedWeight.from_bytes(kind, torch.from_numpy(blocks))
    reference_weight = torch.from_numpy(dequantize(blocks, T[kind])).double()
    x = torch.randn(3, 2 * weights)
    expected = x.double() @ reference_weight.T
    step = x.reshape(3, -1, weights).abs().amax(-1, keepdim=True).double() / 254
    bound = (reference_weight.abs().reshape(1, 64, -1, weights).sum(-1) * step.reshape(3, 1, -1)).sum(-1)
    assert ((weight.linear(x).double() - expected).abs() <= bound + 1e-5).all(), kind


needs_interleaved = pytest.mark.skipif(not interleaved_kernels_available(),
                                       reason="this CPU has no interleaved kernels (AVX2 and a C compiler)")


def _interleaved(kind: str, rows: int, in_features: int, seed: int, tmp_path) -> tuple[QuantizedWeight, np.ndarray]:
    blocks = through_a_gguf_file(tmp_path / "w.gguf", kind, random_blocks(kind, rows, in_features, seed))
    return QuantizedWeight.from_bytes(kind, torch.from_numpy(blocks)), blocks


@needs_interleaved
@pytest.mark.parametrize("kind", sorted(QUANT_TYPES))
def test_interleaved_rows_are_the_same_rows(kind, tmp_path):
    weight, _ = _interleaved(kind, 48, 2 * QUANT_TYPES[kind][1], 8, tmp_path)
    interleaved = weight.interleave()
    assert interleaved.interleaved and interleaved.shape == weight.shape
    assert interleaved.data.shape == weight.data.shape and not torch.equal(interleaved.data, weight.data)
    assert torch.equal(interleaved.dequantize(), weight.dequantize())
    ids = torch.tensor([47, 0, 16, 15, 31, 31])
    assert torch.equal(interleaved.dequantize(ids), weight.dequantize(ids))


@needs_interleaved
@pytest.mark.parametrize("kind", sorted(QUANT_TYPES))
def test_interleaved_int8_computes_exactly_what_it_holds(kind, isa, int8_activations, tmp_path):
    weights = QUANT_TYPES[kind][1]
    in_features = 3 * weights if weights == 256 else 7 * weights
    weight, blocks = _interleaved(kind, 64, in_features, 9, tmp_path)
    interleaved = weight.interleave()
    reference_weight = torch.from_numpy(dequantize(blocks, T[kind])).double()
    bias = torch.randn(64)
    for rows in (1, 2, 3, 4, 5, 13, FUSED_ROWS + 16, 200):  # every row count, two row blocks of 128
        x = representable_rows(rows, in_features, weights, rows)
        expected = x.double() @ reference_weight.T + bias.double()
        got = interleaved.linear(x, bias)
        scale = expected.abs().max().item()
        assert (got.double() - expected).abs().max().item() <= 4 * TOLERANCE[kind] * scale, (kind, rows)


@needs_interleaved
@pytest.mark.parametrize("kind", sorted(QUANT_TYPES))
def test_interleaved_int8_matches_the_gguf_layout(kind, isa, int8_activations, tmp_path):
    """Random rows: the same integer sums and activation scales as the row-by-row int8 loop
    (which takes up to FUSED_ROWS rows), float sums in another order."""
    weights = QUANT_TYPES[kind][1]
    weight, _ = _interleaved(kind, 96, 2 * weights, 10, tmp_path)
    interleaved = weight.interleave()
    for rows in (1, 3, 8, FUSED_ROWS):
        x = torch.randn(rows, 2 * weights)
        expected = weight.linear(x)
        scale = expected.abs().max().item()
        assert (interleaved.linear(x) - expected).abs().max().item() <= 1e-5 * scale, (kind, rows)


@needs_interleaved
@pytest.mark.parametrize("kind", sorted(QUANT_TYPES))
def test_int16_activations_stay_within_their_rounding(kind, isa, int16_activations, tmp_path):
    """15-bit activations on the same scales as int8 ones: each moves by at most half of
    max |x| / 16319 over its 32 (or 256), so each output by at most sum(|w| * step); checked
    at every row count (one tile, several, two blocks of 128 rows), the features of a matrix
    of 96 cut into 6 tiles of 16."""
    weights = QUANT_TYPES[kind][1]
    weight, blocks = _interleaved(kind, 96, 2 * weights, 13, tmp_path)
    interleaved = weight.interleave()
    reference_weight = torch.from_numpy(dequantize(blocks, T[kind])).double()
    bias = torch.randn(96)
    for rows in (1, 2, 7, 8, FUSED_ROWS + 16, 200, 512):
        x = torch.randn(rows, 2 * weights)
        expected = x.double() @ reference_weight.T + bias.double()
        step = x.reshape(rows, -1, weights).abs().amax(-1, keepdim=True).double() / (2 * 16319)
        bound = (reference_weight.abs().reshape(1, 96, -1, weights).sum(-1) * step.reshape(rows, 1, -1)).sum(-1)
        error = (interleaved.linear(x, bias).double() - expected).abs()
        assert (error <= bound + 1e-5 * expected.abs().max()).all(), (kind, rows)


@needs_interleaved
@pytest.mark.parametrize("activations", ["int8", "int16"])
@pytest.mark.parametrize("kind", sorted(QUANT_TYPES))
def test_every_build_gives_the_same_bits(kind, activations, tmp_path):
    """The AVX2 kernels (two parts of 8 rows a tile, vpmaddubsw's int16 sums folded into int32
    before they could overflow, Q8_0's bytes made signed, or its wide activations whole) and
    the AVX-VNNI ones (vpdpbusd on 8 lanes, where the CPU has it) compute the integers and the
    float operations of the AVX-512 VNNI ones: the same bits, at every row count, on
    activations with outlier channels and on extreme blocks (every weight at its type's top or
    bottom, with rows of activations all at +127 or all at -127, where an int16 sum one
    product too many would pass 32767). On a CPU with AVX2 alone, native is the AVX2 build."""
    weights = QUANT_TYPES[kind][1]
    in_features = 2 * weights if weights == 256 else 6 * weights
    random = torch.from_numpy(random_blocks(kind, 96, in_features, 16))
    extreme = torch.from_numpy(random_blocks(kind, 96, in_features, 17))
    _, _, size = QUANT_TYPES[kind]
    scale_bytes = {offset + k for offset in _HALF_OFFSETS[kind] for k in (0, 1)}
    data = extreme.view(96, -1, size)
    top, bottom = (127, 128) if kind == "Q8_0" else (255, 0)  # Q8_0's bytes are int8: 127 and -128
    for position in range(size):
        if position not in scale_bytes:
            data[:48, :, position] = top
            data[48:, :, position] = bottom
    x = torch.randn(200, in_features) * torch.where(torch.rand(in_features) < 0.03, 40.0, 1.0)
    x[:100:2], x[1:100:2] = 1.0, -1.0  # rows whose every activation is at its top, or its bottom
    bias = torch.randn(96)
    builds = ("native", "avx2", "avx2-vnni") if "avx_vnni" in cpu_flags() else ("native", "avx2")
    previous, previous_build, results = quantized_activations(), native.cpu_isa(), {}
    try:
        for build in builds:
            native.set_cpu_isa(build)
            set_quantized_activations(activations)
            results[build] = [QuantizedWeight.from_bytes(kind, blocks).interleave().linear(x[:rows], bias)
                              for blocks in (random, extreme) for rows in (1, 2, 3, 5, 17, 200)]
    finally:
        native.set_cpu_isa(previous_build)
        set_quantized_activations(previous)
    assert len(results) == len(builds) and all(len(outputs) == 12 for outputs in results.values())
    for build in builds[1:]:
        for index, (mine, theirs) in enumerate(zip(results[build], results["native"], strict=True)):
            assert torch.equal(mine, theirs), (build, kind, activations, index)


@needs_interleaved
def test_int16_activations_are_far_closer_than_int8(tmp_path):
    weight, blocks = _interleaved("Q4_1", 64, 512, 14, tmp_path)
    reference_weight = torch.from_numpy(dequantize(blocks, T.Q4_1)).double()
    x = torch.randn(5, 512) * torch.where(torch.rand(512) < 0.02, 50.0, 1.0)  # a few outlier channels
    expected = x.double() @ reference_weight.T
    errors = {}
    for name in ("int8", "int16"):
        previous = quantized_activations()
        set_quantized_activations(name)
        try:
            errors[name] = (weight.interleave().linear(x).double() - expected).abs().max().item()
        finally:
            set_quantized_activations(previous)
    assert errors["int16"] * 50 < errors["int8"], errors


@needs_interleaved
@pytest.mark.parametrize("activations", ["int8", "int16"])
def test_threads_sharing_the_quantization_give_each_rows_own_result(activations, isa, tmp_path):
    """Above 65536 weights the threads quantize a share of the rows each, then multiply their
    share of the features by every row: a batch gives each row what it gives alone (one row
    leaves the first thread no rows to quantize)."""
    weight, _ = _interleaved("Q4_1", 256, 576, 15, tmp_path)
    weight = weight.interleave()
    x = torch.randn(9, 576) * torch.where(torch.rand(576) < 0.03, 40.0, 1.0)
    previous, threads = quantized_activations(), torch.get_num_threads()
    set_quantized_activations(activations)
    torch.set_num_threads(2)  # OpenMP's, which the kernels' regions take
    try:
        together = weight.linear(x)
        alone = [weight.linear(x[r:r + 1]) for r in range(9)]
    finally:
        set_quantized_activations(previous)
        torch.set_num_threads(threads)
    assert len(alone) == 9
    for r, row in enumerate(alone):
        assert torch.equal(together[r:r + 1], row), r


@needs_interleaved
@pytest.mark.parametrize("kind", sorted(QUANT_TYPES))
def test_interleaved_features_may_start_and_end_inside_a_tile(kind, isa):
    """The decode stack's entry takes any range of output features of an interleaved matrix.
    All types but Q6_K take two tiles at a time where the range holds both: features 5..20
    go through a pair, 21..31 through tile 1 alone, and the whole matrix pairs tiles 0 and 1,
    so each feature must come out the same bits either way."""
    import ctypes

    from triode.kernels.native import bind

    pointer, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    quantize = bind("triode_q8_quantize", i32, pointer, i64, i64, i32, pointer)
    q8_bytes = bind("triode_q8_bytes", i64, i32)
    q8_bytes.restype = ctypes.c_int64
    linear_q8 = bind("triode_quant_linear_q8", i32, pointer, i64, i32, pointer, i64, pointer, pointer, i64, i64, i64)
    weight = QuantizedWeight.from_bytes(kind, torch.from_numpy(random_blocks(kind, 48, 256, 11))).interleave()
    x, bias = torch.randn(2, 256), torch.randn(48)
    buffer = torch.empty(q8_bytes(2, 256), dtype=torch.uint8)
    assert quantize(weight.type_id, x.data_ptr(), 256, 2, 256, buffer.data_ptr()) == 0
    previous = quantized_activations()
    set_quantized_activations("int8")
    try:
        expected = weight.linear(x, bias)
    finally:
        set_quantized_activations(previous)
    y = torch.full((2, 48), 7.0)
    for first, last in ((5, 21), (21, 32), (0, 5), (40, 48)):
        assert linear_q8(weight.type_id, buffer.data_ptr(), 2, 256, weight.data.data_ptr(), weight.data.shape[1],
                         bias.data_ptr(), y.data_ptr(), 48, first, last - first) == 0
    assert torch.equal(y[:, 5:32], expected[:, 5:32]) and torch.equal(y[:, :5], expected[:, :5])
    assert torch.equal(y[:, 40:], expected[:, 40:]) and (y[:, 32:40] == 7).all()


@needs_interleaved
def test_only_whole_tiles_of_rows_interleave(int8_activations):
    weight = QuantizedWeight.from_bytes("Q8_0", torch.from_numpy(random_blocks("Q8_0", 40, 64, 12)))
    assert interleaving() and not weight.can_interleave()
    with pytest.raises(ValueError, match="multiple of 16 rows; got 40"):
        weight.interleave()
    interleaved = weight.rows(0, 32).interleave()
    assert not interleaved.can_interleave()  # already
    with pytest.raises(ValueError, match="interleaved Q8_0 matrix"):
        interleaved.rows(0, 16)
    with pytest.raises(ValueError, match="interleaved Q8_0 matrix"):
        interleaved.columns(0, 32)


def test_interleaving_follows_the_activation_type():
    previous = quantized_activations()
    try:
        set_quantized_activations("float32")
        assert not interleaving()
        set_quantized_activations("int8")
        assert interleaving() == interleaved_kernels_available()
        if interleaved_kernels_available():
            set_quantized_activations("int16")
            assert interleaving()
    finally:
        set_quantized_activations(previous)


def test_every_kernel_type_is_kept_by_the_converter():
    assert set(QUANT_TYPES) == KERNEL_TYPES


@pytest.mark.parametrize("kind", sorted(QUANT_TYPES))
@pytest.mark.parametrize("out_features", [37, 96])
def test_linear_matches_dequantize_then_matmul(kind, out_features, isa, tmp_path):
    weights = QUANT_TYPES[kind][1]
    in_features = 3 * weights if weights == 256 else 5 * weights
    blocks = through_a_gguf_file(tmp_path / "w.gguf", kind, random_blocks(kind, out_features, in_features, 1))
    weight = QuantizedWeight.from_bytes(kind, torch.from_numpy(blocks))
    assert weight.shape == (out_features, in_features)
    reference_weight = torch.from_numpy(dequantize(blocks, T[kind])).double()
    bias = torch.randn(out_features)
    for rows in (1, 2, 8, FUSED_ROWS + 16, 512):
        x = torch.randn(rows, in_features)
        expected = x.double() @ reference_weight.T + bias.double()
        got = weight.linear(x, bias)
        scale = expected.abs().max().item()
        assert (got.double() - expected).abs().max().item() <= TOLERANCE[kind] * scale, (kind, rows)


@pytest.mark.parametrize("kind", sorted(QUANT_TYPES))
def test_dequantize_matches_gguf(kind, isa, tmp_path):
    weights = QUANT_TYPES[kind][1]
    blocks = through_a_gguf_file(tmp_path / "w.gguf", kind, random_blocks(kind, 19, 2 * weights, 2))
    weight = QuantizedWeight.from_bytes(kind, torch.from_numpy(blocks))
    expected = torch.from_numpy(dequantize(blocks, T[kind]))
    torch.testing.assert_close(weight.dequantize(), expected, rtol=1e-6, atol=1e-6)
    ids = torch.tensor([18, 0, 7, 7])
    torch.testing.assert_close(weight.dequantize(ids), expected[ids], rtol=1e-6, atol=1e-6)


def test_output_slices_and_strided_rows(isa):
    """Fused layers write each part into its columns of a wider output."""
    blocks = random_blocks("Q8_0", 40, 64, 3)
    weight = QuantizedWeight.from_bytes("Q8_0", torch.from_numpy(blocks))
    x = torch.randn(3, 128)[:, ::2]  # rows with a column stride: copied first
    out = torch.full((3, 100), 7.0)
    weight.linear(x, out=out[:, 30:70])
    expected = x.double() @ torch.from_numpy(dequantize(blocks, T.Q8_0)).double().T
    torch.testing.assert_close(out[:, 30:70].double(), expected, rtol=1e-5, atol=1e-5)
    assert (out[:, :30] == 7).all() and (out[:, 70:] == 7).all()


def test_columns_split_only_on_block_boundaries():
    weight = QuantizedWeight.from_bytes("Q4_K", torch.from_numpy(random_blocks("Q4_K", 4, 512, 4)))
    right = weight.columns(256, 512)
    assert right.shape == (4, 256)
    torch.testing.assert_close(right.dequantize(), weight.dequantize()[:, 256:])
    with pytest.raises(ValueError, match="multiples of 256"):
        weight.columns(0, 128)


def test_activation_types_are_the_engine_settings():
    from triode.engine.config import QUANTIZED_ACTIVATIONS
    from triode.kernels.quant_linear import ACTIVATIONS

    assert QUANTIZED_ACTIVATIONS == ("auto", *ACTIVATIONS)


def test_an_unknown_activation_type_is_refused():
    with pytest.raises(ValueError, match="one of float32, int8, int16; got 'int4'"):
        set_quantized_activations("int4")


@pytest.mark.skipif(interleaved_kernels_available(), reason="this CPU has the interleaved kernels")
def test_int16_activations_need_the_interleaved_kernels():
    with pytest.raises(ValueError, match="need a CPU with AVX2"):
        set_quantized_activations("int16")


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="rows of 64 weights are 68 bytes; got 35"):
        QuantizedWeight("Q8_0", torch.zeros(2, 35, dtype=torch.uint8), 64)
    with pytest.raises(ValueError, match="uint8"):
        QuantizedWeight("Q8_0", torch.zeros(2, 34, dtype=torch.int8), 32)
    with pytest.raises(ValueError):
        QuantizedWeight("Q3_K", torch.zeros(2, 34, dtype=torch.uint8), 32)


def test_row_ids_outside_the_table_raise():
    weight = QuantizedWeight.from_bytes("Q8_0", torch.from_numpy(random_blocks("Q8_0", 5, 32, 5)))
    with pytest.raises(IndexError, match=r"row ids \[0, 5\] outside \[0, 5\)"):
        weight.dequantize(torch.tensor([0, 5]))
    with pytest.raises(IndexError):
        weight.dequantize(torch.tensor([-1]))


@pytest.mark.parametrize(("arguments", "message"), [
    ({"x": torch.randn(2, 32)}, r"x must be float32 \[rows, 64\]; got torch.float32 \[2, 32\]"),
    ({"x": torch.randn(2, 64, dtype=torch.float64)}, r"x must be float32 .* got torch.float64"),
    ({"x": torch.randn(2, 3, 64)}, r"x must be float32 \[rows, 64\]; got torch.float32 \[2, 3, 64\]"),
    ({"x": torch.randn(64)}, r"x must be float32 \[rows, 64\]; got torch.float32 \[64\]"),
    ({"out": torch.empty(2, 8)}, r"out must be float32 \[2, 16\] .* got torch.float32 \[2, 8\]"),
    ({"out": torch.empty(2, 16, dtype=torch.float16)}, r"out must be float32 .* got torch.float16"),
    ({"out": torch.empty(16, 2).t()}, r"out must be .* unit column stride; got .* strides \(1, 2\)"),
    ({"bias": torch.zeros(4)}, r"bias must be float32 \[16\] .* got torch.float32 \[4\]"),
    ({"bias": torch.arange(32.0)[::2]}, r"bias must be .* unit stride; got .* strides \(2,\)"),
])
@pytest.mark.parametrize("interleaved", [False, True])
def test_linear_refuses_what_the_kernels_would_misread(arguments, message, interleaved, int16_activations):
    """The C kernels take raw pointers: a wrong shape, dtype or stride read or wrote memory
    outside the tensors (found by review: a short ``out`` overwritten past its end, a short
    bias or a float16 x a segfault), so they are refused first."""
    weight = QuantizedWeight.from_bytes("Q8_0", torch.from_numpy(random_blocks("Q8_0", 16, 64, 1)))
    if interleaved and not interleaved_kernels_available():
        pytest.skip("this CPU has no interleaved kernels")
    weight = weight.interleave() if interleaved else weight
    with pytest.raises(ValueError, match=message):
        weight.linear(**{"x": torch.randn(2, 64), **arguments})


@pytest.mark.skipif(not interleaved_kernels_available(), reason="this CPU has no interleaved kernels")
def test_the_internal_entry_points_refuse_a_wrong_block_or_range():
    """Called by triode's own code only, with the right values; a wrong block size would read
    past each row, and a negative range write before the output."""
    import ctypes

    pointer, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    interleave = native.bind("triode_quant_x16_interleave", i32, pointer, i64, i64, i32, pointer)
    linear_q8 = native.bind("triode_quant_x16_linear_q8", i32, i32, pointer, i64, i32, pointer, i64, pointer,
                            pointer, i64, i64, i64)
    q8_0 = QUANT_TYPES["Q8_0"][0]
    rows = torch.from_numpy(random_blocks("Q8_0", 16, 64, 4))
    into = torch.empty_like(rows)
    assert [interleave(q8_0, rows.data_ptr(), 68, 16, block, into.data_ptr()) for block in (34, 17, 68)] == [0, -2, -2]
    y = torch.empty(1, 16)
    status = [linear_q8(q8_0 | 0x100, 1, None, 1, 64, into.data_ptr(), 68, None, y.data_ptr(), 16, first, last)
              for first, last in ((0, 0), (-16, 0), (16, 0))]
    assert status == [0, -2, -2]


@pytest.mark.skipif(not interleaved_kernels_available(), reason="this CPU has no interleaved kernels")
@pytest.mark.parametrize("activations", ["int8", "int16"])
@pytest.mark.parametrize("kind", sorted(QUANT_TYPES))
def test_integer_activations_carry_a_nan_or_an_infinity_to_the_outputs(kind, activations, isa):
    """A NaN or an infinity among a row's activations makes every output of that row NaN, as
    float arithmetic does, and leaves the other rows as they were. The span's max |x| once
    dropped a NaN and turned it into the integer -128: finite garbage, different in each
    build. A span of magnitudes under 2^-100 counts as zeros (its scale's inverse would
    overflow)."""
    in_features = 512
    weight = QuantizedWeight.from_bytes(kind, torch.from_numpy(random_blocks(kind, 32, in_features, 2))).interleave()
    previous = quantized_activations()
    set_quantized_activations(activations)
    try:
        x = torch.randn(4, in_features, generator=torch.Generator().manual_seed(3))
        expected = weight.linear(x)
        poisoned = x.clone()
        poisoned[1, 5], poisoned[2, 300] = float("nan"), float("inf")
        tiny = x.clone()
        tiny[3, 256:] = torch.randn(256) * 1e-38
        zeroed = x.clone()
        zeroed[3, 256:] = 0.0
        out = weight.linear(poisoned)
        assert out[1:3].isnan().all()
        assert torch.equal(out[[0, 3]], expected[[0, 3]])
        assert torch.equal(weight.linear(tiny)[3], weight.linear(zeroed)[3])
    finally:
        set_quantized_activations(previous)
