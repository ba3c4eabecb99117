"""Every decoder layer of a decode step in one C call, for models whose layer weights are all
kept in quantized blocks on a CPU (``csrc/decode_stack.c``).

A batch-of-one step of the default model from its Q4_1 file is about 200 kernel calls of tens
of microseconds; the Python around each (module calls, dispatch, argument checks) added a fifth
to the step. :class:`DecodeStack` describes the layers to the C side once (weight, norm and
cache addresses) and checks a step's metadata once; the C side runs the same kernels in the
same order into the same kind of buffers as the Python path, so the hidden states are bit for
bit the same (``tests/test_decode_stack.py``). Steps it does not take (a prefill chunk, more
than :data:`triode.kernels.quant_linear.FUSED_ROWS` rows, unless every weight is interleaved) run
the Python path.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import attrs
import torch

from triode.kernels import quant_linear
from triode.kernels.attention_checks import check_decode_metadata
from triode.kernels.invariance import batch_invariant
from triode.kernels.lora import LoRAMatrix, lora_matrix
from triode.kernels.metadata import AttentionMetadata
from triode.kernels.native import bind
from triode.kernels.quant_linear import QuantizedWeight

MAX_PARTS = 3  # as in the C source
_OPS = {1: "linear", 3: "rotary", 4: "write_kv", 5: "decode attention"}  # as in csrc/decode_stack.h
_OUT_OF_MEMORY = -5
_ACTIVATIONS = {"float32": 0, "int8": 1, "int16": 2}  # csrc/decode_stack.h's ACTIVATIONS_*

__all__ = ["DecodeLayerWeights", "DecodeStack", "decode_stack_available"]


# The structures below mirror csrc/decode_stack.h field for field.
class _Part(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int32), ("out", ctypes.c_int64), ("row_bytes", ctypes.c_int64),
                ("data", ctypes.c_void_p), ("bias", ctypes.c_void_p)]


class _Matrix(ctypes.Structure):
    _fields_ = [("parts", _Part * MAX_PARTS), ("count", ctypes.c_int32)]


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", ctypes.c_void_p), ("post_attention_norm", ctypes.c_void_p),
                ("qkv", _Matrix), ("o", _Matrix), ("gate_up", _Matrix), ("down", _Matrix),
                ("k_cache", ctypes.c_void_p), ("v_cache", ctypes.c_void_p), ("window", ctypes.c_int32),
                ("lora", ctypes.POINTER(LoRAMatrix) * 4)]


class _Model(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int32) for name in (
        "layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate", "block_size",
        "activations")] + [("eps", ctypes.c_float), ("scale", ctypes.c_float),
                                ("num_slots", ctypes.c_int64), ("max_positions", ctypes.c_int64),
                                ("cos_sin", ctypes.c_void_p), ("invariant", ctypes.c_int32)]


def _entry():
    pointer, i64 = ctypes.c_void_p, ctypes.c_int64
    return bind("triode_decode_stack", pointer, pointer, pointer, pointer, i64, pointer, pointer,
                pointer, i64, pointer, pointer, ctypes.POINTER(ctypes.c_int))


def decode_stack_available() -> bool:
    """Whether the C side is built (builds it on the first call)."""
    return _entry() is not None


@attrs.frozen
class DecodeLayerWeights:
    """One layer's weights: its norms (float32 [hidden]) and its four matrices as quantized
    parts stacked along the output features, each with its share of the bias (or None); the
    layer's sliding window (None: it attends to the whole context); and each matrix's LoRA
    stacks (``kernels.lora``'s a, b and slices; None: no adapters), in the order qkv, o,
    gate_up, down."""

    input_norm: torch.Tensor
    post_attention_norm: torch.Tensor
    qkv: Sequence[tuple[QuantizedWeight, torch.Tensor | None]]
    o: Sequence[tuple[QuantizedWeight, torch.Tensor | None]]
    gate_up: Sequence[tuple[QuantizedWeight, torch.Tensor | None]]
    down: Sequence[tuple[QuantizedWeight, torch.Tensor | None]]
    window: int | None = None
    lora: Sequence[tuple[torch.Tensor, torch.Tensor, tuple[int, ...]] | None] = (None, None, None, None)


def _matrix(parts: Sequence[tuple[QuantizedWeight, torch.Tensor | None]], in_features: int, keep: list) -> _Matrix:
    if not 1 <= len(parts) <= MAX_PARTS:
        raise ValueError(f"a matrix of {len(parts)} quantized parts (1 to {MAX_PARTS} are taken)")
    matrix = _Matrix(count=len(parts))
    for slot, (weight, bias) in zip(matrix.parts, parts, strict=False):
        if weight.in_features != in_features:
            raise ValueError(f"a quantized part of {weight.in_features} inputs where {in_features} are expected")
        if bias is not None:
            bias = bias.detach().contiguous()
            keep.append(bias)
        slot.type, slot.out = weight.type_id, weight.out_features
        slot.row_bytes, slot.data = weight.data.shape[1], weight.data.data_ptr()
        slot.bias = None if bias is None else bias.data_ptr()
        keep.append(weight.data)
    return matrix


class DecodeStack:
    """The C description of a model's decoder layers over its KV caches; :meth:`run` takes a
    pure-decode step's embedded tokens through all of them."""

    def __init__(
        self,
        layers: Sequence[DecodeLayerWeights],
        kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        *,
        num_heads: int,
        intermediate_size: int,
        eps: float,
        scale: float,
        rope_cache: torch.Tensor,
    ) -> None:
        k_cache = kv_caches[0][0]
        num_blocks, block_size, kv_heads, head_dim = k_cache.shape
        hidden = layers[0].input_norm.shape[0]
        self._keep: list[torch.Tensor] = [rope_cache]
        self._lora: list[LoRAMatrix] = []
        self._layers = (_Layer * len(layers))()
        for slot, weights, (k, v) in zip(self._layers, layers, kv_caches, strict=True):
            for tensor in (weights.input_norm, weights.post_attention_norm, k, v):
                if tensor.dtype != torch.float32 or not tensor.is_contiguous() or tensor.device.type != "cpu":
                    raise ValueError("the decode stack takes contiguous float32 CPU norms and caches")
            self._keep += [weights.input_norm, weights.post_attention_norm, k, v]
            slot.input_norm, slot.post_attention_norm = (weights.input_norm.data_ptr(),
                                                         weights.post_attention_norm.data_ptr())
            slot.qkv = _matrix(weights.qkv, hidden, self._keep)
            slot.o = _matrix(weights.o, num_heads * head_dim, self._keep)
            slot.gate_up = _matrix(weights.gate_up, hidden, self._keep)
            slot.down = _matrix(weights.down, intermediate_size, self._keep)
            slot.k_cache, slot.v_cache = k.data_ptr(), v.data_ptr()
            slot.window = weights.window or 0
            for index, stacks in enumerate(weights.lora):
                if stacks is None:
                    continue
                matrix = lora_matrix(*stacks)
                if matrix is None:
                    raise ValueError("the decode stack takes LoRA stacks of float32 or bfloat16 on a CPU")
                self._lora.append(matrix)
                self._keep += [stacks[0], stacks[1]]
                slot.lora[index] = ctypes.pointer(matrix)
        self._model = _Model(
            layers=len(layers), hidden=hidden, heads=num_heads, kv_heads=kv_heads, head_dim=head_dim,
            intermediate=intermediate_size, block_size=block_size, eps=eps, scale=scale,
            num_slots=num_blocks * block_size, max_positions=rope_cache.shape[0],
            cos_sin=rope_cache.data_ptr(),
        )
        self.hidden_size = hidden
        self.kv_caches = kv_caches  # the caches it writes: a step over others takes the Python path
        # Interleaved weights run any number of rows (their kernel has no panel path).
        self.max_rows = None if all(weight.interleaved for layer in layers for matrix in
                                    (layer.qkv, layer.o, layer.gate_up, layer.down)
                                    for weight, _ in matrix) else quant_linear.FUSED_ROWS
        self._num_blocks = num_blocks
        self._entry = _entry()

    def takes(self, tokens: int, metadata: AttentionMetadata, kv_caches) -> bool:
        """Whether a step is one this stack runs: decodes only, few enough rows, its caches."""
        return (
            metadata.num_decodes == metadata.num_seqs == tokens
            and 0 < tokens <= (self.max_rows or tokens)
            and kv_caches is self.kv_caches
        )

    def run(
        self, hidden: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata,
        lora_slots: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [tokens, hidden] float32 (the embedded tokens) -> (hidden, residual) after the
        last layer; their sum is the final norm's input. ``lora_slots``: int32 [tokens], each
        row's adapter slot in the layers' LoRA stacks (-1: none), or None for no adapters."""
        tokens = hidden.shape[0]
        if hidden.shape != (tokens, self.hidden_size) or hidden.dtype != torch.float32:
            raise ValueError(f"hidden: expected float32 [tokens, {self.hidden_size}], got "
                             f"{hidden.dtype} {list(hidden.shape)}")
        check_decode_metadata(metadata, self.kv_caches[0][0])
        hidden = hidden.clone(memory_format=torch.contiguous_format)  # written in place
        residual = torch.empty_like(hidden)
        positions = positions.to(torch.int64).contiguous()
        slots = metadata.slot_mapping.contiguous()
        tables, seq_lens = metadata.block_tables, metadata.seq_lens
        if positions.shape != (tokens,) or slots.shape != (tokens,) or slots.dtype != torch.int64:
            raise ValueError("positions and slot_mapping: one int64 entry per token")
        if lora_slots is not None:
            lora_slots = lora_slots.contiguous()
            if lora_slots.shape != (tokens,) or lora_slots.dtype != torch.int32 or not self._lora:
                raise ValueError("lora_slots: one int32 entry per token, for a stack built with LoRA stacks")
            highest = min(matrix.slots for matrix in self._lora)
            if int(lora_slots.max()) >= highest or int(lora_slots.min()) < -1:
                raise ValueError(f"lora_slots: slots must be -1 or below {highest}")
        self._model.activations = _ACTIVATIONS[quant_linear.quantized_activations()]
        self._model.invariant = batch_invariant()
        failed = ctypes.c_int(0)
        status = self._entry(
            ctypes.byref(self._model), self._layers, hidden.data_ptr(), residual.data_ptr(), tokens,
            positions.data_ptr(), slots.data_ptr(), tables.data_ptr(), tables.stride(0),
            seq_lens.data_ptr(), None if lora_slots is None else lora_slots.data_ptr(), ctypes.byref(failed),
        )
        if status:
            if status == _OUT_OF_MEMORY and not failed.value:
                raise MemoryError("decode stack: its scratch buffers could not be allocated")
            raise ValueError(f"decode stack: {_OPS.get(failed.value, 'an op')} failed with status "
                             f"{status} (positions outside the rope cache, or slots outside the caches)")
        return hidden, residual
