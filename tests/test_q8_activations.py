"""Kernels: the quantized activations' buffers (csrc/q8_activations.c) against torch's arithmetic.

The wide activations (15 bits: x_q = round(x * 16319 / max |x|) per span of a row, kept as
128 * q + lo) and the int8 ones are integers, so the C code must give these bytes exactly:
float32 products rounded half to even, as torch rounds them. A share of the rows quantized
into its place in the buffer (as the threads of quant_x16.c do) must give the same bytes as
the whole. Runs with this CPU's build and with the AVX2 one: the same bytes, which a build
without vpdpbusd follows with the wide activations whole, as int16, for its Q8_0 kernel.
"""

from __future__ import annotations

import ctypes

import pytest
import torch

from tests.test_quant_linear import cpu_flags
from triode.kernels import native
from triode.kernels.native import bind
from triode.kernels.quant_linear import QUANT_TYPES, quantized_kernels_available

pytestmark = pytest.mark.skipif(not quantized_kernels_available(), reason="no AVX2 or no C compiler")

WIDE_TOP = 16319.0
SPAN = {"Q4_1": 32, "Q8_0": 32, "Q4_K": 256, "Q6_K": 256}


def _entries():
    pointer, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    rows_entry = bind("triode_q8_quantize_rows", i32, i32, pointer, i64, i64, i32, pointer, i64, i64)
    sizes = {wide: bind(name, i64, i32) for wide, name in ((True, "triode_q8_wide_bytes"), (False, "triode_q8_bytes"))}
    for size in sizes.values():
        size.restype = ctypes.c_int64
    return rows_entry, sizes


def _keeps_whole() -> bool:
    """Whether the build in use keeps x_q whole too (q8_activations.h's Q8_KEEPS_WHOLE: a build
    without vpdpbusd)."""
    if native.cpu_isa() != "native":
        return native.cpu_isa() == "avx2"
    flags = cpu_flags()
    return not ({"avx512f", "avx512bw", "avx512_vnni"} <= flags or "avx_vnni" in flags)


def _activations(rows: int, width: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width, generator=g) * torch.where(torch.rand(width, generator=g) < 0.03, 40.0, 1.0)
    x[0, :32] = 0.0  # a span of zeros: scale 0, every value 0
    return x


def _quantized(kind: str, wide: bool, x: torch.Tensor, shares: list[tuple[int, int]]) -> torch.Tensor:
    quantize_rows, sizes = _entries()
    rows, width = x.shape
    buffer = torch.full((sizes[wide](rows, width),), 0x5A, dtype=torch.uint8)
    for first, last in shares:
        assert quantize_rows(QUANT_TYPES[kind][0], int(wide), x.data_ptr(), width, rows, width,
                             buffer.data_ptr(), first, last) == 0
    return buffer


def _expected(kind: str, wide: bool, x: torch.Tensor) -> dict[str, torch.Tensor]:
    rows, width = x.shape
    span, top = SPAN[kind], WIDE_TOP if wide else 127.0
    spans = x.reshape(rows, width // span, span)
    amax = spans.abs().amax(dim=-1, keepdim=True)
    inverse = torch.where(amax > 0, torch.tensor(top) / amax, torch.zeros(()))
    value = torch.round(spans * inverse).to(torch.int32).reshape(rows, width)  # half to even, as C rounds
    # the C code is built with -ffast-math, which divides by the constant as a multiply by its inverse
    scale = amax * torch.tensor(1.0 / top, dtype=torch.float32)
    parts = {"scale": scale.reshape(rows, -1), "sum": value.reshape(rows, -1, 32).sum(-1)}
    if wide:
        high = torch.div(value + 64, 128, rounding_mode="floor")
        low = value - 128 * high
        parts |= {"q": high, "lo": low, "sum16": high.reshape(rows, -1, 16).sum(-1),
                  "sum16_lo": low.reshape(rows, -1, 16).sum(-1)}
        if _keeps_whole():
            parts["whole"] = value
    else:
        parts |= {"q": value, "sum16": value.reshape(rows, -1, 16).sum(-1)}
    return parts


def _fields(wide: bool, buffer: torch.Tensor, rows: int, width: int, span: int) -> dict[str, torch.Tensor]:
    """The buffer's parts as q8_activations.h lays them out (the scale array has room for one
    scale per 32 whatever the span, and holds one per span from its start)."""
    cuts = {"q": (rows * width, torch.int8), "scale": (rows * (width // 32) * 4, torch.float32),
            "sum": (rows * (width // 32) * 4, torch.int32), "sum16": (rows * (width // 16) * 2, torch.int16)}
    if wide:
        cuts |= {"lo": (rows * width, torch.int8), "sum16_lo": (rows * (width // 16) * 2, torch.int16)}
        if _keeps_whole():
            cuts["whole"] = (rows * width * 2, torch.int16)
    fields, at = {}, 0
    for name, (size, dtype) in cuts.items():
        fields[name] = buffer[at:at + size].view(dtype).reshape(rows, -1)
        at += size
    assert at == buffer.numel()
    fields["scale"] = fields["scale"].flatten()[:rows * (width // span)].reshape(rows, -1)
    return fields


@pytest.mark.parametrize("wide", [True, False], ids=["wide", "int8"])
@pytest.mark.parametrize(("kind", "rows", "width"), [("Q4_1", 1, 576), ("Q4_1", 37, 1536), ("Q8_0", 5, 96),
                                                      ("Q4_K", 9, 512), ("Q6_K", 3, 768)])
def test_buffers_hold_torchs_integers(kind, rows, width, wide, isa):
    x = _activations(rows, width, seed=rows)
    fields = _fields(wide, _quantized(kind, wide, x, [(0, rows)]), rows, width, SPAN[kind])
    expected = _expected(kind, wide, x)
    assert sorted(fields) == sorted(expected)
    for name, want in expected.items():
        assert torch.equal(fields[name], want.to(fields[name].dtype)), name


@pytest.mark.parametrize("wide", [True, False], ids=["wide", "int8"])
def test_shares_of_the_rows_fill_the_same_buffer(wide, isa):
    x = _activations(11, 576, seed=3)
    whole = _quantized("Q4_1", wide, x, [(0, 11)])
    assert torch.equal(_quantized("Q4_1", wide, x, [(6, 11), (0, 2), (2, 6), (4, 4)]), whole)


def test_a_share_outside_the_rows_is_refused():
    quantize_rows, sizes = _entries()
    x = torch.zeros(4, 64)
    buffer = torch.zeros(sizes[True](4, 64), dtype=torch.uint8)
    type_id = QUANT_TYPES["Q4_1"][0]
    results = [quantize_rows(type_id, 1, x.data_ptr(), 64, 4, 64, buffer.data_ptr(), first, last)
               for first, last in ((-1, 2), (0, 5), (3, 2))]
    assert results == [-3, -3, -3]
    assert quantize_rows(type_id, 1, x.data_ptr(), 64, 4, 48, buffer.data_ptr(), 0, 4) == -2
