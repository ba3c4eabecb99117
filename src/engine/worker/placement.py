"""Where and how a runner holds its model: the device, the dtype, which of a checkpoint's
quantized tensors stay quantized, the longest sequence it serves, and the weights loaded so,
with the kernels set up for them."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from triode import kernels
from triode.engine.config import EngineArgs
from triode.engine.errors import InvalidRequestError, ModelLoadError
from triode.engine.model.config import ModelConfig
from triode.engine.worker.checkpoint import (
    SliceSelector,
    blocks_kept_by_shards,
    iter_safetensors,
    quantized_tensors,
)
from triode.engine.worker.distributed import TensorParallelGroup
from triode.engine.worker.models.registry import build_model

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("--device cuda: this torch sees no CUDA device (a CPU build, or no GPU); use "
                             "--device auto or cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    # CPU defaults to fp32: correctness is defined against Hugging Face in fp32, and bf16
    # speed depends on the CPU's bf16 instructions (measured here, with avx512_bf16: a
    # 64-sequence decode step took 178 ms in bf16 and 275-302 ms in fp32).
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


def kept_quantized(kinds: dict[str, str], args: EngineArgs, device: torch.device) -> dict[str, str]:
    """The checkpoint's quantized tensors that the model keeps as they are: all of them on a
    CPU with the quantized kernels when ``--dtype`` is auto (the activations are then
    float32), none elsewhere (they are dequantized to the model's dtype as they load)."""
    if args.quantization and (device.type != "cpu" or not kernels.quantized_kernels_available()):
        raise ModelLoadError(f"--quantization {args.quantization} runs on the quantized CPU kernels, which "
                             f"need a CPU with AVX2 and a C compiler; this worker is on {device}")
    if device.type != "cpu" or args.dtype != "auto" or not kinds:
        return {}
    if not kernels.quantized_kernels_available():
        logger.warning("this CPU has no quantized kernels (they need AVX2 and a C compiler): "
                       "%d quantized tensors are dequantized to float32", len(kinds))
        return {}
    return kinds


def resolve_quantized_activations(name: str) -> str:
    """What quantized weights multiply: ``auto`` is int16 on a CPU whose kernels run integer
    activations over interleaved weights (AVX2 or AVX-512 VNNI), float32 elsewhere; int16
    asked for on another CPU is a start-up error."""
    if name == "auto":
        return "int16" if kernels.interleaved_kernels_available() else "float32"
    if name == "int16" and not kernels.interleaved_kernels_available():
        raise ModelLoadError("--quantized-activations int16 runs on interleaved weights, whose kernels need a "
                             "CPU with AVX2 and a C compiler; this one has none (use auto or float32)")
    return name


def check_batch_invariant(model: nn.Module) -> None:
    """Refuses ``--batch-invariant`` where some kernel would not honour it: int8 activations
    over quantized weights left in GGUF's layout (their loop's tile sizes round differently):
    every matrix on a build without the interleaved kernels, elsewhere those whose rows are not
    a multiple of 16 and a mixture's experts. Every other path has an invariant form
    (:mod:`triode.kernels.invariance`)."""
    if kernels.quantized_activations() != "int8":
        return
    matrices = model.quantized_matrices()
    in_gguf_layout = [matrix for matrix in matrices if not matrix.interleaved]
    if in_gguf_layout:
        shapes = ", ".join(f"{matrix.kind} {list(matrix.shape)}" for matrix in in_gguf_layout[:3])
        raise ModelLoadError(f"--batch-invariant cannot be honoured: int8 activations over weights in GGUF's "
                             f"layout have no invariant kernel, and {len(in_gguf_layout)} of this model's "
                             f"{len(matrices)} quantized matrices stay in it ({shapes}"
                             f"{', ...' if len(in_gguf_layout) > 3 else ''}); use --quantized-activations auto or "
                             f"float32")


def resolve_max_model_len(config: ModelConfig, requested: int | None) -> int:
    limit = config.max_positions
    if requested is None:
        return limit
    if requested > limit:
        raise InvalidRequestError(
            f"max_model_len {requested} exceeds the model's limit of {limit} positions",
            field="max_model_len",
        )
    return requested


def load_weights(path: Path, args: EngineArgs, config: ModelConfig, *, device: torch.device, dtype: torch.dtype,
                 max_positions: int, select: SliceSelector | None = None,
                 parallel: TensorParallelGroup | None = None, head: bool = True) -> tuple[nn.Module, dict[str, str]]:
    """The model from the checkpoint at ``path`` (``select``: this rank's slices under tensor
    parallelism; ``head``: False for a pooling model), and the quantized tensors it keeps as
    blocks, with the kernels set up for them: compiled, their activations chosen, batch
    invariance on or off as ``args`` asks (refused where a kernel would not honour it)."""
    kernels.prepare(device, cache_dir=args.resolved_cache_dir())
    kernels.set_quantized_activations(resolve_quantized_activations(args.quantized_activations))
    quantized = kept_quantized(quantized_tensors(path), args, device)
    if select is not None:
        quantized = blocks_kept_by_shards(quantized, select)
    model = build_model(config, iter_safetensors(path, select=select), dtype=dtype, device=device,
                        max_positions=max_positions, source=str(path), parallel=parallel, quantized=quantized,
                        head=head)
    if args.batch_invariant and quantized:  # after the build, which decides whether the weights interleave
        check_batch_invariant(model)
    kernels.set_batch_invariant(args.batch_invariant)
    if quantized:
        logger.info("%d quantized tensors kept as blocks, %s activations%s", len(quantized),
                    kernels.quantized_activations(),
                    " over rows interleaved 16 at a time" if kernels.quant_linear.interleaving() else "")
    return model, quantized
