"""Reading the tensors of a Hugging Face checkpoint, each converted to the model's dtype and,
under tensor parallelism, sliced to a rank's shard while it is read. The files were found
and checked by :mod:`triode.engine.model_files.layout`.

A checkpoint that triode converted from GGUF may hold quantized weights: uint8 tensors of
GGUF's blocks, named with their block type in the file's metadata under
:data:`QUANTIZED_METADATA_KEY` (:mod:`triode.engine.model_files.gguf_convert` writes them). They are
read as :class:`triode.kernels.quant_linear.QuantizedWeight` and sliced by whole rows or whole blocks
(a shard that would split blocks is read dequantized: :func:`blocks_kept_by_shards`).

No trio here: this runs inside worker processes.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import torch

from triode.engine.errors import ModelLoadError
from triode.engine.model_files.layout import (
    INDEX_FILE,
    QUANTIZED_METADATA_KEY,
    checkpoint_files,
    open_safetensors,
)
from triode.engine.worker.host_memory import weight_tensor
from triode.kernels.quant_linear import QUANT_TYPES, QuantizedWeight

logger = logging.getLogger(__name__)

# For a tensor name: (dim, start, stop) to read only that slice along ``dim``, or None for all.
SliceSelector = Callable[[str], "tuple[int, int, int] | None"]


def _files(path: Path) -> Mapping[Path, frozenset[str] | None]:
    return checkpoint_files(path) if path.is_dir() else {path: None}


def quantized_tensors(path: Path) -> dict[str, str]:
    """Name -> GGUF block type of every quantized weight in the checkpoint (headers only)."""
    kinds: dict[str, str] = {}
    for file in _files(Path(path)):
        with _TensorReader(file) as reader:
            kinds.update(reader.quantized)
    return kinds


def splits_on_blocks(kind: str, spec: tuple[int, int, int] | None) -> bool:
    """Whether a slice ``spec`` of a ``kind`` tensor keeps whole blocks (rows always do)."""
    if spec is None or spec[0] == 0:
        return True
    weights = QUANT_TYPES[kind][1]
    return spec[1] % weights == 0 and spec[2] % weights == 0


def blocks_kept_by_shards(kinds: Mapping[str, str], select: SliceSelector) -> dict[str, str]:
    """The quantized tensors whose tensor-parallel slice keeps whole blocks. Under K types
    (256 weights a block) a row-parallel layer's shard may end inside a block; such a
    tensor is dequantized as it loads, and the log says which."""
    kept = {name: kind for name, kind in kinds.items() if splits_on_blocks(kind, select(name))}
    if split := sorted(set(kinds) - set(kept)):
        logger.warning("%d quantized tensors are dequantized to float32 because this rank's shard "
                       "splits their blocks: %s", len(split), ", ".join(split[:4]) + (" ..." if len(split) > 4 else ""))
    return kept


def iter_safetensors(
    path: Path, *, select: SliceSelector | None = None
) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """Yields every (name, tensor) of the checkpoint in ``path``, single-file or sharded. With
    ``select``, a tensor it maps to a slice is read as that slice only (a tensor-parallel rank
    never holds a whole sharded tensor)."""
    path = Path(path)
    files = _files(path)
    seen: dict[str, Path] = {}
    for file, expected in files.items():
        # safe_open validates the header against the file; the data is read with plain
        # positioned reads into each tensor (no mapping of the file: resident memory while
        # loading is the weights, not the weights plus the file's pages).
        with open_safetensors(file) as handle, _TensorReader(file) as reader:
            names = list(handle.keys())
            for name in names:
                if name in seen:
                    raise ModelLoadError(f"tensor {name} also appears in {seen[name].name}",
                                         path=str(file))
                seen[name] = file
                try:
                    tensor = reader.read(name, select(name) if select is not None else None)
                except Exception as e:
                    raise ModelLoadError(f"cannot read tensor {name}: {e}", path=str(file)) from e
                yield name, tensor
        if expected is not None and (missing := expected.difference(names)):
            raise ModelLoadError(f"tensors listed in {INDEX_FILE} are missing from the shard: "
                                 f"{', '.join(sorted(missing)[:5])}", path=str(file))


_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}


class _TensorReader:
    """Reads tensors, or a slice of one along a dimension, straight from a safetensors file."""

    def __init__(self, file: Path) -> None:
        self._file = open(file, "rb", buffering=0)  # closed by __exit__
        try:
            size = int.from_bytes(self._file.read(8), "little")
            self._entries = json.loads(self._file.read(size))
            self.quantized = self._quantized_kinds(file)
        except BaseException:
            self._file.close()
            raise
        self._data_start = 8 + size

    def _quantized_kinds(self, file: Path) -> dict[str, str]:
        metadata = self._entries.get("__metadata__") or {}
        raw = metadata.get(QUANTIZED_METADATA_KEY) if isinstance(metadata, dict) else None
        if raw is None:
            return {}
        try:
            kinds = json.loads(raw)
        except (TypeError, json.JSONDecodeError) as e:
            raise ModelLoadError(f"metadata {QUANTIZED_METADATA_KEY} is not JSON: {e}", path=str(file)) from e
        if not isinstance(kinds, dict):
            raise ModelLoadError(f"metadata {QUANTIZED_METADATA_KEY} is not a JSON object of tensor names "
                                 f"and block types", path=str(file))
        for name, kind in kinds.items():
            entry = self._entries.get(name)
            if (not isinstance(kind, str) or kind not in QUANT_TYPES or entry is None or entry["dtype"] != "U8"
                    or len(entry["shape"]) != 2):
                raise ModelLoadError(f"quantized tensor {name} ({kind}) is not uint8 rows of a known "
                                     f"block type ({', '.join(QUANT_TYPES)})", path=str(file))
        return kinds

    def __enter__(self) -> _TensorReader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._file.close()

    def _read_into(self, tensor: torch.Tensor, offset: int) -> None:
        view = memoryview(tensor.view(-1).view(torch.uint8).numpy())
        done = 0
        while done < len(view):
            count = os.preadv(self._file.fileno(), [view[done:]], self._data_start + offset + done)
            if count <= 0:
                raise ModelLoadError("the file ends inside the tensor's data")
            done += count

    def read(self, name: str, spec: tuple[int, int, int] | None) -> torch.Tensor | QuantizedWeight:
        """The tensor, or with ``spec = (dim, start, stop)`` only that slice of it."""
        kind = self.quantized.get(name)
        if kind is None:
            return self._read(name, spec)
        if spec is None or spec[0] == 0:
            return QuantizedWeight.from_bytes(kind, self._read(name, spec))
        whole = QuantizedWeight.from_bytes(kind, self._read(name, None))
        if not splits_on_blocks(kind, spec):
            # A shard edge inside a block: these columns load as float32 (blocks_kept_by_shards
            # has already told the runner not to keep this tensor quantized).
            return whole.dequantize()[:, spec[1]:spec[2]].contiguous()
        return whole.columns(spec[1], spec[2])

    def _read(self, name: str, spec: tuple[int, int, int] | None) -> torch.Tensor:
        entry = self._entries[name]
        dtype = _SAFETENSORS_DTYPES.get(entry["dtype"])
        if dtype is None:
            raise ModelLoadError(f"unsupported safetensors dtype {entry['dtype']}")
        shape = list(entry["shape"])
        begin, end = entry["data_offsets"]
        element = torch.empty((), dtype=dtype).element_size()
        if end - begin != math.prod(shape) * element:
            raise ModelLoadError("its data size does not match its shape")
        if spec is None:
            tensor = weight_tensor(shape, dtype)
            self._read_into(tensor, begin)
            return tensor
        dim, start, stop = spec
        if not (0 <= dim < len(shape) and 0 <= start <= stop <= shape[dim]):
            raise ModelLoadError(f"slice [{start}:{stop}] of dim {dim} is outside shape {shape}")
        if math.prod(shape[:dim]) == 1:
            # Leading dims of size 1: the slice is one contiguous range of the data.
            tensor = weight_tensor([*shape[:dim], stop - start, *shape[dim + 1:]], dtype)
            self._read_into(tensor, begin + start * math.prod(shape[dim + 1:]) * element)
            return tensor
        # Strided: read the whole (then transient) tensor and keep the slice.
        whole = torch.empty(shape, dtype=dtype)
        self._read_into(whole, begin)
        return whole.narrow(dim, start, stop - start).clone()
