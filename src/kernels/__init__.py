"""The one dispatch point for triode's hot-path ops.

Models call these functions and nothing else. On CUDA they run Triton kernels, elsewhere the
torch references, except on a CPU where a C compiler could build triode's C kernels
(:mod:`triode.kernels.native`): decode attention (:mod:`triode.kernels.cpu_attention`), the elementwise
ops (:mod:`triode.kernels.cpu_elementwise`) and the sampler's argmax (:mod:`triode.kernels.cpu_argmax`) run
them, and linear layers run oneDNN with weights packed at load time
(:mod:`triode.kernels.packed_linear`), one row (or a small weight) :mod:`triode.kernels.cpu_linear`.
Weights kept in GGUF's quantized blocks are :class:`QuantizedWeight` objects, whose ``linear``
and ``dequantize`` run the C kernels of :mod:`triode.kernels.quant_linear` (CPUs with AVX2 only).
``TRIODE_KERNELS=torch|triton|auto`` (or :func:`set_backend`) overrides the choice for tests
and benchmarks: ``torch`` runs only the references; forcing triton on CPU needs
``TRITON_INTERPRET=1``.

One module per op, each with its torch reference, its Triton kernel and the launcher that checks
the arguments: :mod:`triode.kernels.kv_write`, :mod:`triode.kernels.decode_attention`,
:mod:`triode.kernels.prefill_attention` (composed by :mod:`triode.kernels.paged_attention`, whose
checks are :mod:`triode.kernels.attention_checks`),
:mod:`triode.kernels.rms_norm`, :mod:`triode.kernels.rotary`, :mod:`triode.kernels.silu_mul`,
:mod:`triode.kernels.lora` (batched adapters). This package imports
only torch; triton is imported, and the kernels jitted, on the first Triton launch
(:mod:`triode.kernels._jit`), so it runs where triton is missing and on a bare GPU machine.

Testing helpers: :func:`triode.kernels.testing.triton_interpreter` runs the Triton kernels on CPU
tensors (with ``set_backend("triton")``); ``python -m triode.kernels.compile_check`` compiles every
kernel for a CUDA target without a GPU; ``scripts/gpu_check.py`` checks and times them on one.
"""

from __future__ import annotations

import functools
import os

import torch

from triode.kernels.cpu_argmax import argmax_cpu
from triode.kernels.cpu_elementwise import (
    rms_norm_cpu,
    rotary_embedding_cpu,
    silu_and_mul_cpu,
    write_kv_cpu,
)
from triode.kernels.cpu_linear import (
    invariant_linear_cpu,
    serial_linear,
    serial_linear_supports,
    small_linear_cpu,
)
from triode.kernels.decode_stack import DecodeStack
from triode.kernels.invariance import (
    batch_invariant,
    invariant_linear_reference,
    set_batch_invariant,
)
from triode.kernels.invariant_matmul import invariant_linear_triton
from triode.kernels.kv_write import write_kv_reference, write_kv_triton
from triode.kernels.lora import LoRASegments, add_lora_cpu, add_lora_reference, add_lora_triton
from triode.kernels.metadata import AttentionMetadata
from triode.kernels.moe import fused_experts_reference, fused_experts_triton, route
from triode.kernels.native import native_library, use_cache_dir
from triode.kernels.packed_linear import pack_linear_weight, packed_linear, packed_linear_supports
from triode.kernels.paged_attention import (
    paged_attention_cpu,
    paged_attention_reference,
    paged_attention_triton,
)
from triode.kernels.quant_linear import (
    QuantizedWeight,
    interleaved_kernels_available,
    quantized_activations,
    quantized_kernels_available,
    set_quantized_activations,
)
from triode.kernels.rms_norm import rms_norm_reference, rms_norm_triton
from triode.kernels.rotary import rotary_embedding_reference, rotary_embedding_triton
from triode.kernels.silu_mul import gelu_tanh_and_mul, silu_and_mul_reference, silu_and_mul_triton

BACKENDS = ("auto", "torch", "triton")
_backend = os.environ.get("TRIODE_KERNELS", "auto")

__all__ = [
    "BACKENDS",
    "AttentionMetadata",
    "DecodeStack",
    "LoRASegments",
    "QuantizedWeight",
    "add_lora",
    "argmax",
    "backend_for",
    "batch_invariant",
    "fused_experts",
    "gelu_tanh_and_mul",
    "get_backend",
    "interleaved_kernels_available",
    "linear",
    "pack_linear_weight",
    "paged_attention",
    "prepare",
    "quantized_activations",
    "quantized_kernels_available",
    "rms_norm",
    "rotary_embedding",
    "route_experts",
    "set_backend",
    "set_batch_invariant",
    "set_quantized_activations",
    "silu_and_mul",
    "write_kv",
]


def set_backend(name: str) -> None:
    global _backend
    if name not in BACKENDS:
        raise ValueError(f"kernel backend must be one of {', '.join(BACKENDS)}; got {name!r}")
    _backend = name


def get_backend() -> str:
    """The current setting: 'auto', 'torch' or 'triton'."""
    return _backend


def backend_for(device: torch.device) -> str:
    """'triton' or 'torch' for tensors on ``device`` under the current setting."""
    if _backend == "auto":
        return "triton" if device.type == "cuda" and _triton_available() else "torch"
    if _backend not in BACKENDS:
        raise ValueError(f"TRIODE_KERNELS must be one of {', '.join(BACKENDS)}; got {_backend!r}")
    return _backend


@functools.cache
def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def prepare(device: torch.device, *, cache_dir: str | None = None) -> None:
    """Builds what the ops will need on ``device`` (the C kernels on a CPU, into
    ``cache_dir/kernels``), so that the first step does not pay for it."""
    if device.type == "cpu" and _backend == "auto":
        if cache_dir is not None:
            use_cache_dir(cache_dir)
        native_library()


def _use_triton(tensor: torch.Tensor) -> bool:
    return backend_for(tensor.device) == "triton"


def write_kv(key, value, k_cache, v_cache, slot_mapping) -> None:
    """Scatter key/value [tokens, kv_heads, dim] into the caches at ``slot_mapping``."""
    if _use_triton(key):
        write_kv_triton(key, value, k_cache, v_cache, slot_mapping)
    elif not (_backend == "auto" and write_kv_cpu(key, value, k_cache, v_cache, slot_mapping)):
        write_kv_reference(key, value, k_cache, v_cache, slot_mapping)


def paged_attention(query, key, value, k_cache, v_cache, metadata: AttentionMetadata, scale: float, *,
                    window: int | None = None, softcap: float | None = None):
    """Attention of query [tokens, heads, dim] over the paged cache; returns [tokens, heads, dim].
    The step's key/value must already be in the cache (the Triton path reads only the cache).
    ``window``: a sliding window (each query sees the last ``window`` keys up to itself);
    ``softcap``: scaled scores s become softcap * tanh(s / softcap)."""
    rules = {"window": window, "softcap": softcap}
    if _use_triton(query):
        return paged_attention_triton(query, k_cache, v_cache, metadata, scale, **rules)
    if _backend == "auto" and query.device.type == "cpu":
        return paged_attention_cpu(query, key, value, k_cache, v_cache, metadata, scale, **rules)
    return paged_attention_reference(query, key, value, k_cache, v_cache, metadata, scale, **rules)


def linear(x, weight, bias=None, packed=None):
    """``x @ weight.T + bias``, x [rows, in], weight [out, in]; ``packed``: the weight as
    :func:`pack_linear_weight` made it, or None. On a CPU one row goes to the C loop, more
    rows to oneDNN with the packed weight (without one, the C loop takes a few rows; a small
    float32 weight, which the models do not pack, torch's matmul on the calling thread). With
    :func:`batch_invariant`, :func:`_invariant_linear`."""
    if batch_invariant():
        return _invariant_linear(x, weight, bias)
    if _backend == "auto":
        if packed is None and serial_linear_supports(x, weight):
            return serial_linear(x, weight, bias)
        if (packed is None or x.shape[0] == 1) and (out := small_linear_cpu(x, weight, bias)) is not None:
            return out
        if packed is not None and packed_linear_supports(x, packed, bias):
            return packed_linear(x, packed, bias)
    return torch.nn.functional.linear(x, weight, bias)


def _invariant_linear(x, weight, bias=None):
    """:func:`linear` with each row's result independent of the other rows: the fixed-tile
    Triton matmul, on a CPU the C loop's invariant form, else torch one row at a time."""
    if _use_triton(x):
        return invariant_linear_triton(x.contiguous(), weight, bias)
    if _backend == "auto" and (out := invariant_linear_cpu(x, weight, bias)) is not None:
        return out
    return invariant_linear_reference(x, weight, bias)


def rms_norm(x, weight, eps: float, residual=None):
    """RMSNorm of ``x`` (+ ``residual`` when given); returns (normed, new_residual)."""
    if _use_triton(x):
        return rms_norm_triton(x, weight, eps, residual)
    if _backend == "auto" and (result := rms_norm_cpu(x, weight, eps, residual)) is not None:
        return result
    return rms_norm_reference(x, weight, eps, residual)


def rotary_embedding(positions, query, key, cos_sin_cache) -> None:
    """Rotate query and key in place (neox style)."""
    if _use_triton(query):
        rotary_embedding_triton(positions, query, key, cos_sin_cache)
    elif not (_backend == "auto" and rotary_embedding_cpu(positions, query, key, cos_sin_cache)):
        rotary_embedding_reference(positions, query, key, cos_sin_cache)


def route_experts(logits, top_k: int, *, normalize: bool):
    """(weights float32 [tokens, k], expert ids [tokens, k]) from router logits [tokens, E]."""
    return route(logits, top_k, normalize=normalize)


def fused_experts(x, weights, experts, w_gate_up, w_down, *, packed=None):
    """sum over each token's k experts of weight * down(silu(gate) * up), [tokens, hidden]:
    w_gate_up [E, 2I, hidden] (gate rows then up), w_down [E, hidden, I]. One grouped GEMM
    per projection on CUDA; elsewhere a matmul per expert over its tokens, with ``packed``
    (oneDNN copies of each expert's two weights) on a CPU."""
    if _use_triton(x):
        return fused_experts_triton(x, weights, experts, w_gate_up, w_down, silu_and_mul_triton)
    gate_up_packed, down_packed = packed if packed is not None else (None, None)

    def gate_up(rows, e):
        return linear(rows, w_gate_up[e], packed=None if gate_up_packed is None else gate_up_packed[e])

    def down(rows, e):
        return linear(rows, w_down[e], packed=None if down_packed is None else down_packed[e])

    return fused_experts_reference(x, weights, experts, gate_up, down, silu_and_mul, w_gate_up.shape[0])


def silu_and_mul(x):
    """silu(gate) * up of x [..., 2 * d] (gate then up); returns [..., d]."""
    if _use_triton(x):
        return silu_and_mul_triton(x)
    if _backend == "auto" and (out := silu_and_mul_cpu(x)) is not None:
        return out
    return silu_and_mul_reference(x)


def add_lora(out, x, a, b, slices, segments: LoRASegments) -> None:
    """Adds each segment's adapter to ``out`` in place: ``out[rows, slice i] += (x[rows] @
    a[slot, i].T) @ b[slot, slice i].T`` (``triode.kernels.lora``), each row independent of the
    others on every path."""
    if _use_triton(x):
        add_lora_triton(out, x, a, b, slices, segments)
    elif _backend == "auto":
        add_lora_cpu(out, x, a, b, slices, segments)
    else:
        add_lora_reference(out, x, a, b, slices, segments)


def argmax(x):
    """The index of each row's maximum in x [rows, cols] (the first one; torch's ``argmax(dim=-1)``)."""
    if _backend == "auto" and (out := argmax_cpu(x)) is not None:
        return out
    return x.argmax(dim=-1)
