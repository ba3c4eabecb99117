"""Reading a Hugging Face model directory: its config, its safetensors checkpoint (single or
sharded, validated before any tensor is read), and the tensors themselves, each converted to
the model's dtype and, under tensor parallelism, sliced to a rank's shard while it is read.

No trio here: this runs inside worker processes.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from engine.errors import ModelLoadError

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"


def load_hf_config(path: Path | str) -> dict[str, Any]:
    """Reads ``config.json`` (``path`` is the model directory or the file itself)."""
    path = Path(path)
    file = path / CONFIG_FILE if path.is_dir() else path
    return _read_json(file, "model config")


def _read_json(file: Path, what: str) -> dict[str, Any]:
    try:
        text = file.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ModelLoadError(f"{what} is missing", path=str(file)) from None
    except (OSError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"cannot read {what}: {e}", path=str(file)) from e
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{what} is not valid JSON: {e}", path=str(file)) from e
    if not isinstance(value, dict):
        raise ModelLoadError(f"{what} must be a JSON object", path=str(file))
    return value


def checkpoint_files(path: Path) -> Mapping[Path, frozenset[str] | None]:
    """The checkpoint's safetensors files in load order, each with the tensor names the index
    assigns to it (None without an index). Raises if a file is missing."""
    index = path / INDEX_FILE
    if index.exists():
        weight_map = _read_json(index, "safetensors index").get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelLoadError("safetensors index has no weight_map", path=str(index))
        shards: dict[Path, set[str]] = {}
        for name, shard in weight_map.items():
            if not isinstance(shard, str) or Path(shard).name != shard:
                raise ModelLoadError(f"bad shard name {shard!r} for {name}", path=str(index))
            shards.setdefault(path / shard, set()).add(name)
        for shard in shards:
            if not shard.is_file():
                raise ModelLoadError(f"shard listed in {INDEX_FILE} is missing", path=str(shard))
        return {shard: frozenset(names) for shard, names in shards.items()}
    if (path / "model.safetensors").is_file():
        return {path / "model.safetensors": None}
    files = sorted(path.glob("*.safetensors"))
    if not files:
        ggufs = sorted(p.name for p in path.glob("*.gguf"))
        others = sorted(p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth"))
        hint = (f" (found {', '.join(ggufs)}: pass the .gguf file itself)" if ggufs else
                f" (found {', '.join(others)}: only safetensors checkpoints load)" if others else "")
        raise ModelLoadError(f"no *.safetensors weights in the model directory{hint}",
                             path=str(path))
    return dict.fromkeys(files)


def _open_safetensors(file: Path) -> Any:
    from safetensors import safe_open

    try:
        return safe_open(str(file), framework="pt", device="cpu")
    except Exception as e:
        raise ModelLoadError(f"cannot read safetensors file: {e}", path=str(file)) from e


def validate_hf_dir(path: Path) -> None:
    """Checks config.json and every safetensors header (cheap: headers only, no tensor data)."""
    if not path.is_dir():
        raise ModelLoadError("not a directory", path=str(path))
    load_hf_config(path)
    for file in checkpoint_files(path):
        with _open_safetensors(file):
            pass


# For a tensor name: (dim, start, stop) to read only that slice along ``dim``, or None for all.
SliceSelector = Callable[[str], "tuple[int, int, int] | None"]


def iter_safetensors(
    path: Path, *, select: SliceSelector | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields every (name, tensor) of the checkpoint in ``path``, single-file or sharded. With
    ``select``, a tensor it maps to a slice is read as that slice only (a tensor-parallel rank
    never holds a whole sharded tensor)."""
    path = Path(path)
    files: Mapping[Path, frozenset[str] | None] = (
        checkpoint_files(path) if path.is_dir() else {path: None}
    )
    seen: dict[str, Path] = {}
    for file, expected in files.items():
        # safe_open validates the header against the file; the data is read with plain
        # positioned reads into each tensor (no mapping of the file: resident memory while
        # loading is the weights, not the weights plus the file's pages).
        with _open_safetensors(file) as handle, _TensorReader(file) as reader:
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
        except BaseException:
            self._file.close()
            raise
        self._data_start = 8 + size

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

    def read(self, name: str, spec: tuple[int, int, int] | None) -> torch.Tensor:
        """The tensor, or with ``spec = (dim, start, stop)`` only that slice of it."""
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
            tensor = torch.empty(shape, dtype=dtype)
            self._read_into(tensor, begin)
            return tensor
        dim, start, stop = spec
        if not (0 <= dim < len(shape) and 0 <= start <= stop <= shape[dim]):
            raise ModelLoadError(f"slice [{start}:{stop}] of dim {dim} is outside shape {shape}")
        if math.prod(shape[:dim]) == 1:
            # Leading dims of size 1: the slice is one contiguous range of the data.
            tensor = torch.empty([*shape[:dim], stop - start, *shape[dim + 1:]], dtype=dtype)
            self._read_into(tensor, begin + start * math.prod(shape[dim + 1:]) * element)
            return tensor
        # Strided: read the whole (then transient) tensor and keep the slice.
        whole = torch.empty(shape, dtype=dtype)
        self._read_into(whole, begin)
        return whole.narrow(dim, start, stop - start).clone()
