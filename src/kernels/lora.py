"""Batched LoRA: one step's rows, each with its own adapter (or none), added to a linear
layer's output in one pass (the punica / S-LoRA segmented matmul).

The adapters resident in a worker sit in stacked tensors, one slot each: ``a`` [slots, P * R,
in] holds the A matrices of a layer's P output slices (q, k and v of a fused qkv projection: P
= 3; gate and up: P = 2; otherwise 1), ranks zero-padded to R; ``b`` [slots, out, R] holds the
B matrices with the adapter's scaling folded in, slice i's rows multiplying the i-th R columns
of ``x @ a[slot].T``. The runner orders a step's rows so that each adapter's are contiguous,
and :class:`LoRASegments` names them: rows ``starts[i]:ends[i]`` use slot ``slots[i]``; rows in
no segment are the base model's and are left as they are.

Every path computes each row in an order that depends on its own row alone (a row's result
never changes with the batch it runs in, as ``docs/architecture.md`` requires for recompute):
on a CPU the C loop's invariant one-row form (``triode_invariant_linear_*``) or, without it,
one-row matmuls; in Triton a fixed tiling whose inner dimension is walked from 0 in steps of
the tile, the shrink's result kept in float32.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from triode.kernels._jit import cdiv, lazy_jit, next_power_of_2
from triode.kernels.checks import check_launch_device, check_tensor
from triode.kernels.cpu_linear import invariant_linear_cpu
from triode.kernels.invariance import invariant_linear_reference

if TYPE_CHECKING:
    import triton.language as tl

__all__ = ["LoRASegments", "add_lora_cpu", "add_lora_reference", "add_lora_triton", "check_lora_args"]

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class LoRASegments:
    """Which rows of a step use which adapter slot: rows ``starts[i]:ends[i]`` use
    ``slots[i]``. Segments do not overlap; rows outside every segment use no adapter."""

    __slots__ = ("_tensors", "ends", "slots", "starts")

    def __init__(self, starts: Sequence[int], ends: Sequence[int], slots: Sequence[int]) -> None:
        if not len(starts) == len(ends) == len(slots):
            raise ValueError(f"segments: {len(starts)} starts, {len(ends)} ends and {len(slots)} slots")
        self.starts, self.ends, self.slots = tuple(starts), tuple(ends), tuple(slots)
        self._tensors: dict[torch.device, torch.Tensor] = {}

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
    check_tensor("a", a, ndim=3, dtype=x.dtype, device=x.device, contiguous=True)
    check_tensor("b", b, ndim=3, dtype=x.dtype, device=x.device, contiguous=True)
    if not slices or sum(slices) != out.shape[1] or min(slices) < 1:
        raise ValueError(f"slices: {list(slices)} must be positive and sum to out's {out.shape[1]} columns")
    if a.shape[2] != x.shape[1] or a.shape[1] % len(slices):
        raise ValueError(f"a: expected [slots, {len(slices)} * rank, {x.shape[1]}], got {list(a.shape)}")
    rank = a.shape[1] // len(slices)
    if tuple(b.shape) != (a.shape[0], out.shape[1], rank):
        raise ValueError(f"b: expected {[a.shape[0], out.shape[1], rank]}, got {list(b.shape)}")
    if out.shape[0] != x.shape[0]:
        raise ValueError(f"out: {out.shape[0]} rows for x's {x.shape[0]}")
    previous_end = 0
    for start, end, slot in zip(segments.starts, segments.ends, segments.slots, strict=True):
        if not previous_end <= start <= end <= x.shape[0] or not 0 <= slot < a.shape[0]:
            raise ValueError(f"segments: {segments!r} do not fit {x.shape[0]} rows and {a.shape[0]} slots in order")
        previous_end = end
    return rank


def add_lora_reference(out, x, a, b, slices: Sequence[int], segments: LoRASegments) -> None:
    """The definition, a row at a time: ``out[r, slice i] += (x[r] @ a[s, i].T) @ b[s, slice i].T``
    for each row r of a segment of slot s, in float32."""
    rank = check_lora_args(out, x, a, b, slices, segments)
    for row, slot in enumerate(segments.row_slots(x.shape[0])):
        if slot < 0:
            continue
        shrunk = x[row].float() @ a[slot].float().T
        start = 0
        for index, width in enumerate(slices):
            update = shrunk[index * rank:(index + 1) * rank] @ b[slot, start:start + width].float().T
            out[row, start:start + width] += update.to(out.dtype)
            start += width


def _row_invariant_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    out = invariant_linear_cpu(x, weight)
    return out if out is not None else invariant_linear_reference(x, weight, None)


def add_lora_cpu(out, x, a, b, slices: Sequence[int], segments: LoRASegments) -> None:
    """:func:`add_lora_reference` a segment at a time: one shrink matmul and one expand per
    slice, each row through the row-invariant linear form."""
    rank = check_lora_args(out, x, a, b, slices, segments)
    for start, end, slot in zip(segments.starts, segments.ends, segments.slots, strict=True):
        if start == end:
            continue
        shrunk = _row_invariant_linear(x[start:end], a[slot])
        column = 0
        for index, width in enumerate(slices):
            part = shrunk[:, index * rank:(index + 1) * rank].contiguous()
            out[start:end, column:column + width] += _row_invariant_linear(part, b[slot, column:column + width])
            column += width


@lazy_jit
def _lora_shrink_kernel(
    shrunk_ptr, x_ptr, a_ptr, segments_ptr,
    num_segments, features, width,
    stride_x, stride_a_slot, stride_a_row,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """shrunk[rows of a segment, r-tile] = x @ a[slot].T, in float32."""
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
        ws = tl.load(a_ptr + slot * stride_a_slot + cols[None, :] * stride_a_row + ks[:, None],
                     mask=col_mask[None, :] & k_mask[:, None], other=0.0)
        acc += tl.dot(xs.to(tl.float32), ws.to(tl.float32), input_precision="ieee")
    tl.store(shrunk_ptr + rows[:, None].to(tl.int64) * width + cols[None, :], acc,
             mask=row_mask[:, None] & col_mask[None, :])


@lazy_jit
def _lora_expand_kernel(
    out_ptr, shrunk_ptr, b_ptr, segments_ptr,
    num_segments, rank, width, column, shrunk_column, shrunk_width,
    stride_out, stride_b_slot,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """out[rows of a segment, column + n-tile] += shrunk[rows, slice] @ b[slot, column + n].T"""
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
    ws = tl.load(b_ptr + slot * stride_b_slot + (column + cols[None, :]) * rank + ranks[:, None],
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
    width = a.shape[1]
    shrunk = torch.empty((x.shape[0], width), dtype=torch.float32, device=x.device)
    block_m, block_k = 16, 64
    block_r = max(16, next_power_of_2(min(width, 64)))
    _lora_shrink_kernel[(len(segments), cdiv(longest, block_m), cdiv(width, block_r))](
        shrunk, x, a, table, len(segments), x.shape[1], width,
        x.stride(0), a.stride(0), a.stride(1),
        BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=block_k,
    )
    block_n, block_rank = 64, max(16, next_power_of_2(rank))
    column = 0
    for index, slice_width in enumerate(slices):
        _lora_expand_kernel[(len(segments), cdiv(longest, block_m), cdiv(slice_width, block_n))](
            out, shrunk, b, table, len(segments), rank, slice_width, column, index * rank, width,
            out.stride(0), b.stride(0),
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=block_rank,
        )
        column += slice_width
