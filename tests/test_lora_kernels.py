"""Kernel tests for the batched LoRA op (triode.kernels.lora): the Triton kernels under triton's
interpreter and the CPU path against the row-at-a-time definition, with odd shapes, rows of
the base model between adapters' segments and an empty segment; each row's result the same
bits alone as in a batch (the C loop with this CPU's build and the AVX2 one, `isa`); and the
argument checks."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from triode import kernels
from triode.kernels.lora import LoRASegments, add_lora_cpu, add_lora_reference, add_lora_triton
from triode.kernels.testing import triton_interpreter

pytestmark = pytest.mark.kernels

TOLERANCE = {torch.float32: {"atol": 2e-5, "rtol": 1e-5}, torch.float16: {"atol": 3e-3, "rtol": 3e-3}}


def _problem(dtype, *, rows=37, features=40, slices=(24, 8, 8), rank=8, slots=3, seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, features, generator=generator).to(dtype)
    a = (torch.randn(slots, features, len(slices) * rank, generator=generator) / 4).to(dtype)
    b = (torch.randn(slots, rank, sum(slices), generator=generator) / 4).to(dtype)
    out = torch.randn(rows, sum(slices), generator=generator).to(dtype)
    return out, x, a, b


# rows 0-4 base, 5-13 slot 2, an empty segment of slot 0, 14-29 slot 0, 30 base, 31-36 slot 1
SEGMENTS = LoRASegments((5, 14, 14, 31), (14, 14, 30, 37), (2, 0, 0, 1))


def test_segments_of_rows_and_back():
    row_slots = [-1, -1, 2, 2, 0, -1, 0, 0, 1]
    segments = LoRASegments.of_rows(row_slots)
    assert (segments.starts, segments.ends, segments.slots) == ((2, 4, 6, 8), (4, 5, 8, 9), (2, 0, 0, 1))
    assert segments.row_slots(len(row_slots)) == row_slots
    assert len(LoRASegments.of_rows([-1, -1])) == 0


def test_reference_is_the_definition():
    out, x, a, b = _problem(torch.float32, slices=(6, 4), rank=3, rows=4, features=5)
    expected = out.clone()
    row_slots = [1, -1, 0, 1]
    for row, slot in enumerate(row_slots):
        if slot >= 0:
            delta_q = x[row] @ a[slot, :, :3] @ b[slot, :, :6]
            delta_v = x[row] @ a[slot, :, 3:] @ b[slot, :, 6:]
            expected[row] += torch.cat([delta_q, delta_v])
    add_lora_reference(out, x, a, b, (6, 4), LoRASegments.of_rows(row_slots))
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("slices", [(24, 8, 8), (33,), (17, 17)], ids=["qkv", "one", "gate-up"])
def test_cpu_matches_reference(slices, isa):
    out, x, a, b = _problem(torch.float32, slices=slices)
    expected = out.clone()
    add_lora_reference(expected, x, a, b, slices, SEGMENTS)
    untouched = out[:5].clone()
    add_lora_cpu(out, x, a, b, slices, SEGMENTS)
    torch.testing.assert_close(out, expected, **TOLERANCE[torch.float32])
    assert torch.equal(out[:5], untouched)  # the base model's rows


def test_cpu_with_bfloat16_weights_matches_reference(isa):
    out, x, a, b = _problem(torch.float32)
    a, b = a.bfloat16(), b.bfloat16()
    expected = out.clone()
    add_lora_reference(expected, x, a, b, (24, 8, 8), SEGMENTS)
    add_lora_cpu(out, x, a, b, (24, 8, 8), SEGMENTS)
    torch.testing.assert_close(out, expected, **TOLERANCE[torch.float32])


def test_cpu_without_the_c_loop_matches_reference():
    """bfloat16 rows are not the C loop's: one-row matmuls a segment at a time."""
    out, x, a, b = _problem(torch.bfloat16)
    expected = out.clone()
    add_lora_reference(expected, x, a, b, (24, 8, 8), SEGMENTS)
    add_lora_cpu(out, x, a, b, (24, 8, 8), SEGMENTS)
    torch.testing.assert_close(out.float(), expected.float(), atol=3e-2, rtol=3e-2)


def test_cpu_rows_are_batch_invariant(isa):
    out, x, a, b = _problem(torch.float32, rows=64, features=576, slices=(576, 192, 192), rank=16)
    batched = out.clone()
    add_lora_cpu(batched, x, a, b, (576, 192, 192), LoRASegments((0,), (64,), (1,)))
    for row in (0, 7, 63):
        alone = out[row:row + 1].clone()
        add_lora_cpu(alone, x[row:row + 1].clone(), a, b, (576, 192, 192), LoRASegments((0,), (1,), (1,)))
        assert torch.equal(alone[0], batched[row])


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("slices,rank", [((24, 8, 8), 8), ((33,), 16), ((17, 17), 5)], ids=["qkv-r8", "one-r16", "gate-up-r5"])
def test_triton_matches_reference(slices, rank, dtype):
    out, x, a, b = _problem(dtype, slices=slices, rank=rank)
    expected = out.clone()
    add_lora_reference(expected, x, a, b, slices, SEGMENTS)
    with triton_interpreter():
        add_lora_triton(out, x, a, b, slices, SEGMENTS)
    torch.testing.assert_close(out.float(), expected.float(), **TOLERANCE[dtype])


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_triton_without_segments_changes_nothing():
    out, x, a, b = _problem(torch.float32)
    before = out.clone()
    with triton_interpreter():
        add_lora_triton(out, x, a, b, (24, 8, 8), LoRASegments((), (), ()))
    assert torch.equal(out, before)


def test_dispatch_on_cpu_runs_the_cpu_path():
    out, x, a, b = _problem(torch.float32)
    expected = out.clone()
    add_lora_cpu(expected, x, a, b, (24, 8, 8), SEGMENTS)
    kernels.add_lora(out, x, a, b, (24, 8, 8), SEGMENTS)
    assert torch.equal(out, expected)


@pytest.mark.parametrize("change,message", [
    (lambda out, x, a, b: (out, x, a, b[:, :, :-1].contiguous()), "b: expected"),
    (lambda out, x, a, b: (out, x[:, :-1].contiguous(), a, b), "a: expected"),
    (lambda out, x, a, b: (out[:-1], x, a, b), "out: 36 rows"),
    (lambda out, x, a, b: (out, x, a.double(), b.double()), "a: expected dtype"),
])
def test_argument_checks_name_the_argument(change, message):
    args = change(*_problem(torch.float32))
    with pytest.raises(ValueError, match=message):
        add_lora_cpu(*args, (24, 8, 8), SEGMENTS)


def test_segments_out_of_range_are_refused():
    out, x, a, b = _problem(torch.float32)
    for segments in (LoRASegments((0,), (38,), (0,)), LoRASegments((0,), (3,), (3,)),
                     LoRASegments((4, 0), (8, 3), (0, 0))):
        with pytest.raises(ValueError, match="segments"):
            add_lora_cpu(out, x, a, b, (24, 8, 8), segments)
    with pytest.raises(ValueError, match="slices"):
        add_lora_cpu(out, x, a, b, (24, 8, 7), SEGMENTS)
