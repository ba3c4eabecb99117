"""``--quantization``: a float safetensors checkpoint quantized once, at load, into the cache.

The weights go into the block formats the quantized CPU kernels already run, so a quantized
Hugging Face model and a GGUF file take one path through the worker:

- ``int8``: every linear weight as Q8_0, int8 with a scale per 32 weights of a row. That is
  per-channel int8 with finer scales, for 6% more bytes than one scale per row.
- ``int4``: the decoder layers' projections as Q4_1, 4 bits with a scale and a minimum per
  group of 32 weights; the embedding and LM head as Q8_0, as llama.cpp's 4-bit presets keep
  their output layer at higher precision.

Norms, biases and weights whose rows are not whole blocks stay float32. The entry is a
Hugging Face directory like the GGUF conversions: the source's config, tokenizer and
generation files copied, and one model.safetensors written by
:mod:`triode.engine.model_files.tensor_writer`. It runs in the engine process, while it resolves
the model, reading one tensor at a time.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from triode.engine.errors import InvalidRequestError
from triode.engine.model_files.default_model import say
from triode.engine.model_files.layout import (
    INDEX_FILE,
    QUANTIZED_METADATA_KEY,
    checkpoint_files,
    load_hf_config,
    open_safetensors,
)
from triode.engine.model_files.tensor_writer import PlannedTensor, write_safetensors

# --quantization value -> (block type of the decoder layers' projections, of the embedding
# and LM head).
QUANTIZATIONS = {"int8": ("Q8_0", "Q8_0"), "int4": ("Q4_1", "Q8_0")}
_BLOCK_WEIGHTS = 32
_EDGE_TENSORS = ("model.embed_tokens.weight", "lm_head.weight")


def check_quantizable(path: Path, quantization: str) -> None:
    """Raises InvalidRequestError (field ``quantization``) unless ``path`` is a float
    checkpoint that ``quantization`` can be applied to."""
    config = load_hf_config(path)
    if method := (config.get("quantization_config") or {}).get("quant_method"):
        raise _error(f"the model is already quantized ({method}, config.json's quantization_config); "
                     f"run it without --quantization")
    for file in checkpoint_files(path):
        with open_safetensors(file) as reader:
            if QUANTIZED_METADATA_KEY in (reader.metadata() or {}):
                raise _error("the model is already quantized (triode's GGUF blocks); "
                             "run it without --quantization")


def quantize_checkpoint(source: Path, out_dir: Path, quantization: str, *, progress: bool) -> None:
    """Writes ``source`` (which :func:`check_quantizable` has passed) quantized as
    ``quantization`` into ``out_dir``."""
    say(progress, f"quantizing {source.name} to {quantization} (one-time) ...")
    started = time.monotonic()
    for item in source.iterdir():
        # Everything but the weights: config, tokenizer, generation config, chat templates.
        if item.is_file() and item.suffix != ".safetensors" and item.name != INDEX_FILE:
            shutil.copyfile(item, out_dir / item.name)
    tensors = _plan(source, quantization)
    write_safetensors(out_dir / "model.safetensors", tensors, progress)
    kept = sum(1 for t in tensors if t.kind is not None)
    say(progress, f"quantized in {time.monotonic() - started:.1f} s ({kept} of {len(tensors)} tensors)")


def _plan(source: Path, quantization: str) -> list[PlannedTensor]:
    layer_kind, edge_kind = QUANTIZATIONS[quantization]
    planned = []
    for file, names in checkpoint_files(source).items():
        with open_safetensors(file, framework="pt") as reader:
            keys = [name for name in reader.keys() if names is None or name in names]
            shapes = {name: list(reader.get_slice(name).get_shape()) for name in keys}
        for name in keys:
            shape = shapes[name]
            kind = edge_kind if name in _EDGE_TENSORS else layer_kind if name.endswith("_proj.weight") else None
            if len(shape) != 2 or shape[1] % _BLOCK_WEIGHTS:
                kind = None
            planned.append(PlannedTensor(name, kind, *_stored(kind, shape),
                                         produce=_producer(file, name, kind)))
    return planned


def _stored(kind: str | None, shape: list[int]) -> tuple[list[int], int]:
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    if kind is None:
        return shape, 4 * int(np.prod(shape))
    weights, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
    row_bytes = shape[1] // weights * nbytes
    return [shape[0], row_bytes], shape[0] * row_bytes


def _producer(file: Path, name: str, kind: str | None):
    def produce():
        import numpy as np
        import torch
        from gguf import GGMLQuantizationType
        from gguf.quants import quantize

        with open_safetensors(file, framework="pt") as reader:
            values = reader.get_tensor(name).to(torch.float32).numpy()
        return values if kind is None else quantize(np.ascontiguousarray(values), GGMLQuantizationType[kind])

    return produce


def _error(message: str) -> InvalidRequestError:
    return InvalidRequestError(f"quantization: {message}", field="quantization")


__all__ = ["QUANTIZATIONS", "check_quantizable", "quantize_checkpoint"]
