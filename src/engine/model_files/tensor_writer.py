"""One safetensors file streamed to disk a tensor at a time, quantized weights included.

Both converters that build cache entries write through here: GGUF files
(:mod:`triode.engine.model_files.gguf_convert`) and safetensors checkpoints quantized at load
(:mod:`triode.engine.model_files.quantize`). A quantized weight is stored as uint8 rows of GGUF
blocks and listed in the file's metadata under
:data:`triode.engine.model_files.layout.QUANTIZED_METADATA_KEY`; everything else is float32.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs

from triode.engine.errors import ModelLoadError
from triode.engine.model_files.default_model import say
from triode.engine.model_files.layout import QUANTIZED_METADATA_KEY

PROGRESS_EVERY_S = 5.0


@attrs.frozen
class PlannedTensor:
    """One tensor of the output: its name, block type (None: float32), shape as stored, size,
    and how to produce its bytes when they are written."""

    name: str
    kind: str | None
    shape: list[int]
    nbytes: int
    produce: Callable[[], Any]


def write_safetensors(path: Path, tensors: list[PlannedTensor], progress: bool) -> None:
    """Streams ``tensors`` into one safetensors file, one tensor in memory at a time."""
    import numpy as np

    header: dict[str, Any] = {}
    offset = 0
    for t in tensors:
        header[t.name] = {"dtype": "U8" if t.kind else "F32", "shape": t.shape,
                          "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    quantized = {t.name: t.kind for t in tensors if t.kind}
    header["__metadata__"] = {"format": "pt", QUANTIZED_METADATA_KEY: json.dumps(quantized, sort_keys=True)}
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    written, reported = 0, time.monotonic()
    with open(path, "wb") as f:
        f.write(len(encoded).to_bytes(8, "little"))
        f.write(encoded)
        for t in tensors:
            data = np.ascontiguousarray(t.produce())
            if data.nbytes != t.nbytes:
                raise ModelLoadError(f"tensor {t.name}: {data.nbytes} bytes, expected {t.nbytes}")
            f.write(data.data)
            written += t.nbytes
            if progress and time.monotonic() - reported >= PROGRESS_EVERY_S:
                reported = time.monotonic()
                say(progress, f"  {written / offset:.0%} of {offset / 1e9:.2f} GB written")
