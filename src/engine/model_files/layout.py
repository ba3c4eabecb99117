"""A Hugging Face model directory's files: config.json and the safetensors checkpoint (single
or sharded), read and checked before any worker loads a tensor (headers only: no tensor
data, and no torch)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from triode.engine.errors import ModelLoadError

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
# safetensors metadata: JSON object, tensor name -> GGUF block type of a quantized weight.
QUANTIZED_METADATA_KEY = "triode.quantized"


def load_hf_config(path: Path | str) -> dict[str, Any]:
    """Reads ``config.json`` (``path`` is the model directory or the file itself)."""
    path = Path(path)
    file = path / CONFIG_FILE if path.is_dir() else path
    return read_json(file, "model config")


def read_json(file: Path, what: str) -> dict[str, Any]:
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
        weight_map = read_json(index, "safetensors index").get("weight_map")
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


def open_safetensors(file: Path, framework: str = "numpy") -> Any:
    """safetensors' reader, which validates the header against the file (numpy: no torch)."""
    from safetensors import safe_open

    try:
        return safe_open(str(file), framework=framework, device="cpu")
    except Exception as e:
        raise ModelLoadError(f"cannot read safetensors file: {e}", path=str(file)) from e


def validate_hf_dir(path: Path) -> None:
    """Checks config.json and every safetensors header (cheap: headers only, no tensor data)."""
    if not path.is_dir():
        raise ModelLoadError("not a directory", path=str(path))
    load_hf_config(path)
    for file in checkpoint_files(path):
        with open_safetensors(file):
            pass
