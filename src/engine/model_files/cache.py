"""The conversion cache: entries (Hugging Face directories triode built, such as a dequantized
GGUF) are built in a temporary sibling, validated, sealed by a manifest written last, and
renamed into place, all under a file lock, so a crash or a second process can never leave a
half-written entry that gets loaded. It runs in the engine process, while it resolves the
model, before any worker starts.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from triode.engine.errors import ModelLoadError
from triode.engine.model_files.default_model import say
from triode.engine.model_files.layout import validate_hf_dir

MARKER_FILE = ".triode-complete.json"
_MARKER_VERSION = 1


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
