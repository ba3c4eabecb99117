"""Linear layers and embedding lookups over weights kept in GGUF's quantized blocks, on CPUs
(``csrc/quant_linear.c``).

A :class:`QuantizedWeight` is a matrix [out, in] stored as GGUF stores it: each row its
blocks back to back, as a uint8 tensor [out, row_bytes]. Up to :data:`FUSED_ROWS` rows of
activations go to the C loop, which decodes each group of 32 weights into registers once and
multiplies it into every row (float32 throughout). More rows, a prefill, run as a float32
matrix multiply over panels of the weight dequantized by the C code: the decode is then paid
once per panel for all the rows, and the multiply runs at the matrix library's speed. With
:func:`set_quantized_activations` ``("int8")`` the C loop quantizes the activations to int8
first and multiplies bytes by bytes, as llama.cpp does (faster at one or two rows).

Integer activations run over weights interleaved 16 rows at a time
(:meth:`QuantizedWeight.interleave`, ``csrc/quant_x16.h``), which a model does at load
(:func:`interleaving`): the same bytes in an order that lets one instruction multiply 4
weights of 16 rows (AVX-512 VNNI's vpdpbusd; two, of 8 rows each, with AVX2), several times
fewer instructions per weight than GGUF's row-by-row order. Both builds give the same bits.
There the activations may also be 15-bit integers (``"int16"``, the default where available:
two such products per weight byte, and results as close to float32 as its sums allow).

With :func:`set_batch_invariant` ``(True)`` a row's result does not depend on the other rows of
the call: weights in GGUF's layout then run the float32 C loop at every row count, in tiles
whose sums keep one order (``triode_quant_linear``'s ``invariant``), never the panels; int8
activations over them are refused. Interleaved weights are invariant as they are.

On a CPU without AVX2, or without a C compiler, there are no quantized kernels
(:func:`quantized_kernels_available` is False) and a model dequantizes its weights at load
instead (:meth:`QuantizedWeight.dequantize` then uses the ``gguf`` package's numpy code).
"""

from __future__ import annotations

import ctypes
import functools

import attrs
import torch

from triode.kernels.invariance import batch_invariant
from triode.kernels.native import bind, cpu_isa

# GGUF type name -> (GGMLQuantizationType value, weights per block, bytes per block).
QUANT_TYPES: dict[str, tuple[int, int, int]] = {
    "Q4_0": (2, 32, 18),
    "Q4_1": (3, 32, 20),
    "Q8_0": (8, 32, 34),
    "Q4_K": (12, 256, 144),
    "Q5_K": (13, 256, 176),
    "Q6_K": (14, 256, 210),
}
# Rows the fused C loop takes; beyond them a step dequantizes panels. Measured on the default
# model's Q4_1 layers (2-core AVX2, ms for 30 layers' matmuls, C loop / panel + MKL): 8 rows
# 22 / 78, 32 rows 112 / 126, 64 rows 212 / 191, 128 rows 474 / 293. Interleaved weights
# take every row count.
FUSED_ROWS = 48
# Weights per dequantized panel (whole output rows): 4 MiB of float32, so a panel stays in cache.
PANEL_WEIGHTS = 1 << 20
_NOT_BUILT = -4
_X16 = 0x100  # csrc/quant_x16.h's TYPE_X16: the matrix is interleaved 16 rows at a time
INTERLEAVED_ROWS = 16
# What the few-row C loop multiplies the weights with: float32 activations (results as close to
# the dequantized model's as float32 sums allow), or activations quantized to int8 with a scale
# per 32 (per 256 for the K types), as llama.cpp does (csrc/quant_linear_int8.c: fewer
# instructions per weight, results further off), or to 15-bit integers on the same scales
# (int16: interleaved weights only, csrc/quant_x16.c; logprobs within 2.4e-3 of float32's on the
# default model, where int8 ones moved them by 0.25 and changed its answers).
ACTIVATIONS = ("float32", "int8", "int16")
_activations = "float32"  # triode.engine.config.EngineArgs.quantized_activations sets it in a worker

__all__ = [
    "ACTIVATIONS",
    "FUSED_ROWS",
    "INTERLEAVED_ROWS",
    "QUANT_TYPES",
    "QuantizedWeight",
    "interleaved_kernels_available",
    "interleaving",
    "quantized_activations",
    "quantized_kernels_available",
    "set_quantized_activations",
]


def set_quantized_activations(name: str) -> None:
    """float32, int8 or int16 activations for quantized weights, from now on in this process
    (int16 needs :func:`interleaved_kernels_available`)."""
    global _activations
    if name not in ACTIVATIONS:
        raise ValueError(f"quantized activations must be one of {', '.join(ACTIVATIONS)}; got {name!r}")
    if name == "int16" and not interleaved_kernels_available():
        raise ValueError("int16 activations run on interleaved weights, whose kernels need a CPU with AVX2 "
                         "(and a C compiler); use float32 here")
    _activations = name


def quantized_activations() -> str:
    return _activations


@functools.cache
def _entries(isa: str):
    pointer, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    linear_args = (i32, pointer, i64, pointer, i64, pointer, pointer, i64, i64, i32, i64)
    linear = bind("triode_quant_linear", *linear_args, i32)  # the last: batch invariant
    linear_int8 = bind("triode_quant_linear_int8", *linear_args)
    dequantize = bind("triode_quant_dequantize", i32, pointer, i64, pointer, i64, i64, i32, pointer, i64)
    if linear is None or linear_int8 is None or dequantize is None:
        return None
    x, weight, y = torch.zeros(1, 32), torch.zeros(1, 34, dtype=torch.uint8), torch.empty(1, 1)
    if linear(QUANT_TYPES["Q8_0"][0], x.data_ptr(), 32, weight.data_ptr(), 34, None, y.data_ptr(),
              1, 1, 32, 1, 0) == _NOT_BUILT:
        return None  # built for a CPU without AVX2
    return linear, dequantize, linear_int8


@functools.cache
def _interleave_entry(isa: str):
    """(the C function that interleaves a matrix, the kernel that reads it) where the build has
    that kernel (AVX2 or AVX-512 VNNI), else None."""
    pointer, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    interleave = bind("triode_quant_x16_interleave", i32, pointer, i64, i64, i32, pointer)
    x16_linear = bind("triode_quant_x16_linear", i32, i32, pointer, i64, pointer, i64, pointer, pointer, i64,
                      i64, i32, i64)
    if interleave is None or x16_linear is None or _entries(isa) is None:
        return None
    probe = x16_linear(0, 0, None, 0, None, 0, None, None, 0, 0, 0, 0)
    return None if probe == _NOT_BUILT else (interleave, x16_linear)  # built without AVX2


def _kernels():
    return _entries(cpu_isa())


def quantized_kernels_available() -> bool:
    """Whether this CPU runs quantized weights as they are (AVX2 and a C compiler)."""
    return _kernels() is not None


def interleaved_kernels_available() -> bool:
    """Whether this build runs integer activations over interleaved weights (AVX2 or AVX-512
    VNNI)."""
    return _interleave_entry(cpu_isa()) is not None


def interleaving() -> bool:
    """Whether a model loaded now interleaves its quantized matrices: integer activations, on
    a CPU whose build has the interleaved kernels."""
    return _activations != "float32" and interleaved_kernels_available()


def _check(status: int, what: str) -> None:
    if status:
        raise ValueError(f"{what}: the C kernel refused its arguments (status {status})")


@attrs.frozen
class QuantizedWeight:
    """A weight matrix [out_features, in_features] in one GGUF block type: ``data`` is uint8
    [out_features, row_bytes], each row ``in_features / block`` blocks."""

    kind: str = attrs.field(validator=attrs.validators.in_(QUANT_TYPES))
    data: torch.Tensor = attrs.field(converter=lambda tensor: tensor.contiguous())
    in_features: int
    # The rows are interleaved 16 at a time (csrc/quant_x16.h): the same bytes per row, read
    # by the integer-activation kernels only; made by interleave().
    interleaved: bool = attrs.field(default=False, kw_only=True)

    def __attrs_post_init__(self) -> None:
        _, weights, size = QUANT_TYPES[self.kind]
        if self.data.dtype != torch.uint8 or self.data.dim() != 2:
            raise ValueError(f"{self.kind} data must be uint8 [rows, bytes]; got {self.data.dtype} "
                             f"{list(self.data.shape)}")
        if self.in_features % weights or self.data.shape[1] != self.in_features // weights * size:
            raise ValueError(f"{self.kind} rows of {self.in_features} weights are "
                             f"{self.in_features // weights * size} bytes; got {self.data.shape[1]}")

    @property
    def type_id(self) -> int:
        """The type number the C kernels take: GGUF's, with the interleaved flag."""
        return QUANT_TYPES[self.kind][0] | (_X16 if self.interleaved else 0)

    @classmethod
    def from_bytes(cls, kind: str, data: torch.Tensor) -> QuantizedWeight:
        """The weight whose rows are ``data`` [out, row_bytes] (in_features follows)."""
        _, weights, size = QUANT_TYPES[kind]
        return cls(kind, data, data.shape[1] // size * weights)

    @property
    def out_features(self) -> int:
        return self.data.shape[0]

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    @property
    def block_weights(self) -> int:
        return QUANT_TYPES[self.kind][1]

    def rows(self, start: int, stop: int) -> QuantizedWeight:
        self._check_gguf_layout("rows")
        return QuantizedWeight(self.kind, self.data[start:stop], self.in_features)

    def columns(self, start: int, stop: int) -> QuantizedWeight:
        """Columns [start, stop), which must fall on block boundaries."""
        self._check_gguf_layout("columns")
        _, weights, size = QUANT_TYPES[self.kind]
        if start % weights or stop % weights:
            raise ValueError(f"{self.kind} weights split only at multiples of {weights} columns; "
                             f"asked for [{start}:{stop}]")
        data = self.data[:, start // weights * size: stop // weights * size].contiguous()
        return QuantizedWeight(self.kind, data, stop - start)

    def _check_linear_arguments(self, x: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> None:
        # The C kernels take raw pointers: a wrong shape, dtype or stride would read or write
        # memory outside these tensors.
        if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != self.in_features:
            raise ValueError(f"x must be float32 [rows, {self.in_features}]; got {x.dtype} {list(x.shape)}")
        if out.dtype != torch.float32 or out.shape != (x.shape[0], self.out_features) or (
                out.stride(-1) != 1 and self.out_features > 1):
            raise ValueError(f"out must be float32 [{x.shape[0]}, {self.out_features}] with unit column stride; "
                             f"got {out.dtype} {list(out.shape)}, strides {out.stride()}")
        if bias is not None and (bias.dtype != torch.float32 or bias.shape != (self.out_features,)
                                 or not bias.is_contiguous()):
            raise ValueError(f"bias must be float32 [{self.out_features}] with unit stride; got {bias.dtype} "
                             f"{list(bias.shape)}, strides {bias.stride()}")

    def _check_gguf_layout(self, what: str) -> None:
        if self.interleaved:
            raise ValueError(f"{what} of an interleaved {self.kind} matrix: slice it before interleaving")

    def can_interleave(self) -> bool:
        return interleaving() and not self.interleaved and self.out_features % INTERLEAVED_ROWS == 0

    def interleave(self, allocate=torch.empty) -> QuantizedWeight:
        """The same matrix with its rows interleaved 16 at a time, in a buffer from
        ``allocate(shape, dtype)`` (the loader passes one in huge pages). Needs
        :func:`interleaved_kernels_available` and a multiple of 16 rows."""
        entries = _interleave_entry(cpu_isa())
        if entries is None:
            raise RuntimeError("interleaved kernels are not built for this CPU (they need AVX2)")
        if self.interleaved:
            return self
        if self.out_features % INTERLEAVED_ROWS:
            raise ValueError(f"interleaving takes a multiple of {INTERLEAVED_ROWS} rows; got {self.out_features}")
        data = allocate(list(self.data.shape), dtype=torch.uint8)
        _check(entries[0](QUANT_TYPES[self.kind][0], self.data.data_ptr(), self.data.shape[1], self.out_features,
                          QUANT_TYPES[self.kind][2], data.data_ptr()), "interleave")
        return QuantizedWeight(self.kind, data, self.in_features, interleaved=True)

    def dequantize(self, ids: torch.Tensor | None = None) -> torch.Tensor:
        """float32 [len(ids) or out, in]: the rows ``ids``, or all rows. A row id outside
        [0, out) raises IndexError, as an embedding lookup does (the C code reads any row)."""
        count = self.out_features if ids is None else ids.numel()
        if ids is not None and count:
            low, high = torch.aminmax(ids)
            if low < 0 or high >= self.out_features:
                raise IndexError(f"row ids [{int(low)}, {int(high)}] outside [0, {self.out_features})")
        entries = _kernels()
        if entries is None:
            return self._dequantize_numpy(ids)
        out = torch.empty((count, self.in_features), dtype=torch.float32)
        if count:
            ids = None if ids is None else ids.to(torch.int64).contiguous()
            _check(entries[1](self.type_id, self.data.data_ptr(), self.data.shape[1],
                              None if ids is None else ids.data_ptr(), 0, count,
                              self.in_features, out.data_ptr(), out.stride(0)), "dequantize")
        return out

    def _dequantize_numpy(self, ids: torch.Tensor | None) -> torch.Tensor:
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        data = self.data if ids is None else self.data[ids]
        values = dequantize(data.numpy(), GGMLQuantizationType[self.kind])
        return torch.from_numpy(values.astype("float32", copy=False).reshape(data.shape[0], -1))

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ weight.T + bias`` for float32 rows x [rows, in], into ``out`` [rows,
        out_features] (a column slice of a wider tensor is fine) or a new tensor."""
        entries = _kernels()
        if entries is None:
            raise RuntimeError("quantized kernels are not available on this CPU")
        x = x if x.stride(-1) == 1 else x.contiguous()
        rows = x.shape[0]
        if out is None:
            out = torch.empty((rows, self.out_features), dtype=torch.float32)
        self._check_linear_arguments(x, bias, out)
        if rows == 0:
            return out
        kind = self.type_id
        arguments = (x.data_ptr(), x.stride(0), self.data.data_ptr(), self.data.shape[1],
                     None if bias is None else bias.data_ptr(), out.data_ptr(), out.stride(0), rows,
                     self.in_features, self.out_features)
        if self.interleaved:
            # Integer activations only (interleaving() made it so): int8, else the 15-bit ones,
            # at any row count (2-4x faster than dequantized panels from 16 to 2048 rows).
            wide = int(_activations != "int8")
            _check(_interleave_entry(cpu_isa())[1](kind, wide, *arguments), f"{self.kind} linear")
            return out
        if batch_invariant() and _activations == "int8":
            raise RuntimeError("int8 activations over weights in GGUF's layout have no batch-invariant "
                               "kernel (their tiles' instantiations may round differently)")
        if batch_invariant():
            _check(entries[0](kind, *arguments, 1), f"{self.kind} linear")
            return out
        if rows <= FUSED_ROWS:
            status = entries[2](kind, *arguments) if _activations == "int8" else entries[0](kind, *arguments, 0)
            _check(status, f"{self.kind} linear")
            return out
        step = max(1, PANEL_WEIGHTS // self.in_features)
        panel = torch.empty((min(step, self.out_features), self.in_features), dtype=torch.float32)
        for start in range(0, self.out_features, step):
            stop = min(start + step, self.out_features)
            _check(entries[1](kind, self.data.data_ptr(), self.data.shape[1], None, start, stop - start,
                              self.in_features, panel.data_ptr(), panel.stride(0)), "dequantize")
            part = panel[: stop - start]
            out[:, start:stop] = torch.nn.functional.linear(
                x, part, None if bias is None else bias[start:stop])
        return out
