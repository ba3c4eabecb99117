"""Batched LoRA: one step's rows, each with its own adapter (or none), added to a linear
layer's output in one pass (the punica / S-LoRA segmented matmul).

The adapters resident in a worker sit in stacked tensors, one slot each, both transposed: ``a``
[slots, in, P * R] holds the A matrices of a layer's P output slices (q, k and v of a fused qkv
projection: P = 3; gate and up: P = 2; otherwise 1) side by side, ranks zero-padded to R; ``b``
[slots, R, out] holds the B matrices with the adapter's scaling folded in, slice i's columns
multiplying the i-th R values of ``x @ a[slot]``. (Transposed, both halves on a CPU are axpys
over contiguous vectors: ``csrc/lora.c``.) The runner orders a step's rows so that each adapter's are contiguous,
and :class:`LoRASegments` names them: rows ``starts[i]:ends[i]`` use slot ``slots[i]``; rows in
no segment are the base model's and are left as they are.

Every path computes each row in an order that depends on its own row alone (a row's result
never changes with the batch it runs in, as ``docs/architecture.md`` requires for recompute):
on a CPU the C loop (``csrc/lora.c``), or without it one-row matmuls; in Triton a fixed tiling whose inner dimension is walked from 0 in steps of
the tile, the shrink's result kept in float32.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from triode.kernels._jit import cdiv, lazy_jit, next_power_of_2
from triode.kernels.checks import check_launch_device, check_tensor
from triode.kernels.native import bind

if TYPE_CHECKING:
    import triton.language as tl

__all__ = ["LoRAMatrix", "LoRASegments", "add_lora_cpu", "add_lora_reference", "add_lora_triton", "check_lora_args",
           "lora_matrix"]

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class LoRASegments:
    """Which rows of a step use which adapter slot: rows ``starts[i]:ends[i]`` use
    ``slots[i]``. Segments do not overlap; rows outside every segment use no adapter."""

    __slots__ = ("_row_slots", "_tensors", "ends", "slots", "starts")

    def __init__(self, starts: Sequence[int], ends: Sequence[int], slots: Sequence[int]) -> None:
        if not len(starts) == len(ends) == len(slots):
            raise ValueError(f"segments: {len(starts)} starts, {len(ends)} ends and {len(slots)} slots")
        self.starts, self.ends, self.slots = tuple(starts), tuple(ends), tuple(slots)
        self._tensors: dict[torch.device, torch.Tensor] = {}
        self._row_slots: dict[int, torch.Tensor] = {}

    @classmethod
    def of_rows(cls, row_slots: Sequence[int]) -> LoRASegments:
        """The segments of a step whose row r uses slot ``row_slots[r]`` (-1: none)."""
        starts, ends, slots = [], [], []
        for row, slot in enumerate(row_slots):
            if slot < 0:
                continue
            if slots and slots[-1] == slot and ends[-1] == row:
                ends[-1] = row + 1
            else:
                starts.append(row)
                ends.append(row + 1)
                slots.append(slot)
        return cls(starts, ends, slots)

    def __len__(self) -> int:
        return len(self.slots)

    def __repr__(self) -> str:
        return f"LoRASegments({list(zip(self.starts, self.ends, self.slots, strict=True))})"

    def row_slots(self, rows: int) -> list[int]:
        """Each of ``rows`` rows' slot, -1 for none."""
        slots = [-1] * rows
        for start, end, slot in zip(self.starts, self.ends, self.slots, strict=True):
            slots[start:end] = [slot] * (end - start)
        return slots

    def row_slot_tensor(self, rows: int) -> torch.Tensor:
        """:meth:`row_slots` as an int32 CPU tensor, made once (every adapted layer of a step
        reads it)."""
        if rows not in self._row_slots:
            self._row_slots[rows] = torch.tensor(self.row_slots(rows), dtype=torch.int32)
        return self._row_slots[rows]

    def tensor(self, device: torch.device) -> torch.Tensor:
        """int32 [3, segments] (starts, ends, slots) on ``device``, made once."""
        if device not in self._tensors:
            self._tensors[device] = torch.tensor([self.starts, self.ends, self.slots], dtype=torch.int32,
                                                 device=device).reshape(3, len(self.slots))
        return self._tensors[device]


def check_lora_args(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                    slices: Sequence[int], segments: LoRASegments) -> int:
    """Raises ValueError naming the argument that does not fit; returns the rank R."""
    check_tensor("x", x, ndim=2, dtype=FLOAT_DTYPES)
    check_tensor("out", out, ndim=2, dtype=x.dtype, device=x.device)
    check_tensor("a", a, ndim=3, dtype=FLOAT_DTYPES, device=x.device, contiguous=True)
    check_tensor("b", b, ndim=3, dtype=a.dtype, device=x.device, contiguous=True)
    if not slices or sum(slices) != out.shape[1] or min(slices) < 1:
        raise ValueError(f"slices: {list(slices)} must be positive and sum to out's {out.shape[1]} columns")
    if a.shape[1] != x.shape[1] or a.shape[2] % len(slices):
        raise ValueError(f"a: expected [slots, {x.shape[1]}, {len(slices)} * rank], got {list(a.shape)}")
    rank = a.shape[2] // len(slices)
    if tuple(b.shape) != (a.shape[0], rank, out.shape[1]):
        raise ValueError(f"b: expected {[a.shape[0], rank, out.shape[1]]}, got {list(b.shape)}")
    if out.shape[0] != x.shape[0]:
        raise ValueError(f"out: {out.shape[0]} rows for x's {x.shape[0]}")
    previous_end = 0
    for start, end, slot in zip(segments.starts, segments.ends, segments.slots, strict=True):
        if not previous_end <= start <= end <= x.shape[0] or not 0 <= slot < a.shape[0]:
            raise ValueError(f"segments: {segments!r} do not fit {x.shape[0]} rows and {a.shape[0]} slots in order")
        previous_end = end
    return rank


def add_lora_reference(out, x, a, b, slices: Sequence[int], segments: LoRASegments) -> None:
    """The definition, a row at a time: ``out[r, slice i] += (x[r] @ a[s][:, i-th R]) @
    b[s][:, slice i]`` for each row r of a segment of slot s, in float32."""
    rank = check_lora_args(out, x, a, b, slices, segments)
    for row, slot in enumerate(segments.row_slots(x.shape[0])):
        if slot < 0:
            continue
        shrunk = x[row].float() @ a[slot].float()
        start = 0
        for index, width in enumerate(slices):
            update = shrunk[index * rank:(index + 1) * rank] @ b[slot, :, start:start + width].float()
            out[row, start:start + width] += update.to(out.dtype)
            start += width


MAX_PARTS = 3  # as csrc/lora.h's MAX_LORA_PARTS


class LoRAMatrix(ctypes.Structure):
    """csrc/lora.h's ``lora_matrix``, field for field."""

    _fields_ = [("a", ctypes.c_void_p), ("b", ctypes.c_void_p), ("bf16", ctypes.c_int32), ("rank", ctypes.c_int32),
                ("parts", ctypes.c_int32), ("in_features", ctypes.c_int64), ("out", ctypes.c_int64),
                ("slots", ctypes.c_int64), ("slices", ctypes.c_int64 * MAX_PARTS)]


def lora_matrix(a: torch.Tensor, b: torch.Tensor, slices: Sequence[int]) -> LoRAMatrix | None:
    """The C description of a layer's stacks (their memory must outlive it), or None where the
    C loop does not take them (not float32 or bfloat16 on a CPU, more than 3 slices)."""
    if (a.device.type != "cpu" or a.dtype not in (torch.float32, torch.bfloat16) or len(slices) > MAX_PARTS
            or not a.is_contiguous() or not b.is_contiguous()):
        return None
    rank = a.shape[2] // len(slices)
    return LoRAMatrix(a=a.data_ptr(), b=b.data_ptr(), bf16=int(a.dtype == torch.bfloat16), rank=rank,
                      parts=len(slices), in_features=a.shape[1], out=b.shape[2], slots=a.shape[0],
                      slices=(ctypes.c_int64 * MAX_PARTS)(*slices))


@functools.cache
def _entry():
    pointer, i64 = ctypes.c_void_p, ctypes.c_int64
    return bind("triode_lora_f32", pointer, pointer, i64, pointer, i64, pointer, pointer, i64)


def _one_row_matmuls(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    # each row the same one-row matmul on a fresh copy: a BLAS kernel's order can follow the
    # batch's shape and a row's alignment
    return torch.cat([x[row:row + 1].clone() @ weight for row in range(x.shape[0])])


def add_lora_cpu(out, x, a, b, slices: Sequence[int], segments: LoRASegments) -> None:
    """:func:`add_lora_reference` by the C loop where it takes the tensors (float32 rows with
    unit column stride); else a segment at a time in one-row matmuls. Either way each row's
    result is independent of the others."""
    rank = check_lora_args(out, x, a, b, slices, segments)
    matrix = lora_matrix(a, b, slices) if x.dtype == torch.float32 and x.stride(1) == 1 else None
    if matrix is not None and out.stride(1) == 1 and (entry := _entry()) is not None:
        row_slots = segments.row_slot_tensor(x.shape[0])
        shrunk = torch.empty((x.shape[0], a.shape[2]), dtype=torch.float32)
        if entry(ctypes.byref(matrix), x.data_ptr(), x.stride(0), row_slots.data_ptr(), x.shape[0],
                 shrunk.data_ptr(), out.data_ptr(), out.stride(0)):
            raise ValueError(f"lora: slices {list(slices)} do not fit")
        return
    for start, end, slot in zip(segments.starts, segments.ends, segments.slots, strict=True):
        if start == end:
            continue
        shrunk = _one_row_matmuls(x[start:end].float(), a[slot].float())
        column = 0
        for index, width in enumerate(slices):
            part = shrunk[:, index * rank:(index + 1) * rank]
            out[start:end, column:column + width] += _one_row_matmuls(
                part, b[slot, :, column:column + width].float()).to(out.dtype)
            column += width


@lazy_jit
def _lora_shrink_kernel(
    shrunk_ptr, x_ptr, a_ptr, segments_ptr,
    num_segments, features, width,
    stride_x, stride_a_slot,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """shrunk[rows of a segment, r-tile] = x @ a[slot], in float32."""
    segment = tl.program_id(0)
    start = tl.load(segments_ptr + segment)
    end = tl.load(segments_ptr + num_segments + segment)
    slot = tl.load(segments_ptr + 2 * num_segments + segment).to(tl.int64)
    rows = start + tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)  # tiles past the end mask all
    cols = tl.program_id(2) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_mask = rows < end
    col_mask = cols < width
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k in range(0, features, BLOCK_K):
        ks = k + tl.arange(0, BLOCK_K)
        k_mask = ks < features
        xs = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_x + ks[None, :],
                     mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        ws = tl.load(a_ptr + slot * stride_a_slot + ks[:, None] * width + cols[None, :],
                     mask=col_mask[None, :] & k_mask[:, None], other=0.0)
        acc += tl.dot(xs.to(tl.float32), ws.to(tl.float32), input_precision="ieee")
    tl.store(shrunk_ptr + rows[:, None].to(tl.int64) * width + cols[None, :], acc,
             mask=row_mask[:, None] & col_mask[None, :])


@lazy_jit
def _lora_expand_kernel(
    out_ptr, shrunk_ptr, b_ptr, segments_ptr,
    num_segments, rank, width, column, shrunk_column, shrunk_width, out_width,
    stride_out, stride_b_slot,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """out[rows of a segment, column + n-tile] += shrunk[rows, slice] @ b[slot][:, column + n]"""
    segment = tl.program_id(0)
    start = tl.load(segments_ptr + segment)
    end = tl.load(segments_ptr + num_segments + segment)
    slot = tl.load(segments_ptr + 2 * num_segments + segment).to(tl.int64)
    rows = start + tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    ranks = tl.arange(0, BLOCK_R)
    row_mask = rows < end
    col_mask = cols < width
    rank_mask = ranks < rank
    hs = tl.load(shrunk_ptr + rows[:, None].to(tl.int64) * shrunk_width + shrunk_column + ranks[None, :],
                 mask=row_mask[:, None] & rank_mask[None, :], other=0.0)
    ws = tl.load(b_ptr + slot * stride_b_slot + ranks[:, None] * out_width + column + cols[None, :],
                 mask=col_mask[None, :] & rank_mask[:, None], other=0.0)
    update = tl.dot(hs, ws.to(tl.float32), input_precision="ieee")
    pointers = out_ptr + rows[:, None].to(tl.int64) * stride_out + column + cols[None, :]
    mask = row_mask[:, None] & col_mask[None, :]
    current = tl.load(pointers, mask=mask, other=0.0).to(tl.float32)
    tl.store(pointers, (current + update).to(out_ptr.dtype.element_ty), mask=mask)


def add_lora_triton(out, x, a, b, slices: Sequence[int], segments: LoRASegments) -> None:
    """Same contract as :func:`add_lora_reference`: a shrink kernel into float32, then an
    expand kernel per slice, each over (segment, row tile, column tile)."""
    rank = check_lora_args(out, x, a, b, slices, segments)
    check_launch_device("x", x)
    if not len(segments) or not x.shape[0]:
        return
    longest = max(end - start for start, end in zip(segments.starts, segments.ends, strict=True))
    if not longest:
        return
    table = segments.tensor(x.device)
    width = a.shape[2]
    shrunk = torch.empty((x.shape[0], width), dtype=torch.float32, device=x.device)
    block_m, block_k = 16, 64
    block_r = max(16, next_power_of_2(min(width, 64)))
    _lora_shrink_kernel[(len(segments), cdiv(longest, block_m), cdiv(width, block_r))](
        shrunk, x, a, table, len(segments), x.shape[1], width,
        x.stride(0), a.stride(0),
        BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=block_k,
    )
    block_n, block_rank = 64, max(16, next_power_of_2(rank))
    column = 0
    for index, slice_width in enumerate(slices):
        _lora_expand_kernel[(len(segments), cdiv(longest, block_m), cdiv(slice_width, block_n))](
            out, shrunk, b, table, len(segments), rank, slice_width, column, index * rank, width, out.shape[1],
            out.stride(0), b.stride(0),
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=block_rank,
        )
        column += slice_width
