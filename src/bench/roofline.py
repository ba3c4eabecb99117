"""What a workload's arithmetic allows on this machine, for ``triode bench throughput --peer``.

A workload's multiply-adds are counted from the model's configuration: every projection of
every layer for each token fed (a prompt's tokens, then each sampled token but the last), the
LM head for each token sampled, and attention's two products (q.k and p.v) for each position
a token attends to. Divided by the fastest matrix multiply measured here in the same run (the
model's own matrix shapes at 256 rows, in the dtype an engine computes in), they give the
**ceiling**: the output tokens/s an engine would reach if all of its arithmetic ran at that
peak and nothing else took time. No engine passes it, so a goal above it cannot be met on
this machine by any engine, only by doing less arithmetic or cheaper arithmetic.

For triode's default configuration (quantized weights) the peak is that of its quantized
kernel over the model's Q4_1 MLP shape, with the activations it uses by default.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Mapping, Sequence

import attrs

from triode.bench.workloads import Workload

PEAK_ROWS = 256  # rows of the measured multiplies: a busy decode step's, a short prefill's
_MEASURE_SECONDS = 0.3


@attrs.frozen
class ModelArithmetic:
    """Multiply-adds of a decoder: ``linear`` per token fed, ``head`` per token sampled,
    ``attention`` per token and position it attends to (all layers)."""

    linear: int
    head: int
    attention: int
    hidden: int
    intermediate: int
    vocab: int

    @classmethod
    def from_config(cls, config: Mapping) -> ModelArithmetic:
        """From a Hugging Face ``config.json`` of a Llama-shaped decoder (grouped-query
        attention, a gated MLP)."""
        hidden, layers = config["hidden_size"], config["num_hidden_layers"]
        heads = config["num_attention_heads"]
        head_dim = config.get("head_dim") or hidden // heads
        kv_heads = config.get("num_key_value_heads") or heads
        intermediate = config["intermediate_size"]
        per_layer = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2 + 3 * hidden * intermediate
        return cls(linear=layers * per_layer, head=hidden * config["vocab_size"],
                   attention=layers * 2 * heads * head_dim, hidden=hidden, intermediate=intermediate,
                   vocab=config["vocab_size"])

    def workload_flops(self, workload: Workload) -> float:
        """Floating-point operations (two per multiply-add) to run ``workload`` to its output
        lengths."""
        macs = 0
        for prompt, outputs in zip(workload.prompts, workload.output_lens, strict=True):
            fed = len(prompt) + outputs - 1  # the last sampled token is never fed
            attended = fed * (fed + 1) // 2  # the token at position p attends to p + 1 positions
            macs += fed * self.linear + outputs * self.head + attended * self.attention
        return 2.0 * macs

    def shapes(self) -> list[tuple[int, int]]:
        """(in, out) of the model's largest multiplies: the MLP's, and the LM head's."""
        return [(self.hidden, 2 * self.intermediate), (self.intermediate, self.hidden), (self.hidden, self.vocab)]


def ceiling_tokens_per_second(workload: Workload, flops: float, peak_flops: float) -> float:
    """Output tokens/s if ``flops`` ran at ``peak_flops`` and nothing else took time."""
    return workload.total_output_tokens / (flops / peak_flops)


def _rate(run, flops: float) -> float:
    """Floating-point operations per second of ``run``, best over a short stretch."""
    run()
    best = float("inf")
    deadline = time.perf_counter() + _MEASURE_SECONDS
    while time.perf_counter() < deadline:
        started = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - started)
    return flops / best


def gemm_peak_flops(dtype: str, shapes: Sequence[tuple[int, int]], *, threads: int) -> float:
    """The fastest matrix multiply over ``shapes`` at :data:`PEAK_ROWS` rows, in ``dtype``:
    torch's ``F.linear`` (MKL in float32, oneDNN in bfloat16) or oneDNN with the weight packed
    once, as triode's layers and vLLM's CPU build run it. On an AMD EPYC Zen 5, float32, MKL
    reached 237 GFLOP/s and packed oneDNN 561: a peak of MKL's alone put both engines above
    their "ceiling"."""
    import torch

    from triode.kernels.packed_linear import pack_linear_weight, packed_linear

    torch.set_num_threads(threads)
    kind = getattr(torch, dtype)
    best = 0.0
    for inputs, outputs in shapes:
        x, weight = torch.randn(PEAK_ROWS, inputs).to(kind), torch.randn(outputs, inputs).to(kind)
        flops = 2.0 * PEAK_ROWS * inputs * outputs
        best = max(best, _rate(functools.partial(torch.nn.functional.linear, x, weight), flops))
        packed = pack_linear_weight(weight)
        if packed is not None:
            best = max(best, _rate(functools.partial(packed_linear, x, packed), flops))
    return best


def quantized_peak_flops(shapes: Sequence[tuple[int, int]], *, threads: int, activations: str,
                         kind: str = "Q4_1") -> float:
    """The fastest of triode's quantized kernels over ``shapes`` at :data:`PEAK_ROWS` rows, in
    ``kind`` blocks with ``activations`` (interleaved where those are integers, as a model
    loads them); for the LM head shape, Q8_0 (the default model's embedding)."""
    import numpy
    import torch
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    from triode.kernels import quant_linear

    torch.set_num_threads(threads)
    before = quant_linear.quantized_activations()
    quant_linear.set_quantized_activations(activations)
    try:
        best = 0.0
        for inputs, outputs in shapes:
            block = "Q8_0" if outputs > 8 * inputs else kind
            values = numpy.random.default_rng(0).standard_normal((outputs, inputs), dtype=numpy.float32)
            weight = quant_linear.QuantizedWeight.from_bytes(
                block, torch.from_numpy(quantize(values, GGMLQuantizationType[block])))
            if weight.can_interleave():
                weight = weight.interleave()
            x = torch.randn(PEAK_ROWS, inputs)
            best = max(best, _rate(functools.partial(weight.linear, x), 2.0 * PEAK_ROWS * inputs * outputs))
        return best
    finally:
        quant_linear.set_quantized_activations(before)
