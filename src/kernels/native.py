"""triode's C kernels for CPUs (``csrc/*.c``): built on first use, loaded with ctypes.

The sources are compiled with the system C compiler (``$CC``, else ``cc``) for this CPU
(``-march=native``) into one shared library under ``<cache>/kernels/`` (the engine's cache
directory, given by :func:`use_cache_dir`; a per-user temporary directory when no engine set
it), named by a hash of the sources, the flags and the compiler, so every start after the
first costs a ``dlopen``.
Without a compiler (or if the build fails) :func:`native_library` returns None, the reason
is logged once, and the ops take their torch references. The library links the
``libgomp.so.1`` that torch has already loaded, so the kernels share torch's OpenMP thread
pool (``torch.set_num_threads`` governs both).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import subprocess
import tempfile
from pathlib import Path

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = tuple(sorted(_CSRC.glob("*.c")))
_HEADERS = tuple(sorted(_CSRC.glob("*.h")))
# -ffast-math lets the dot products vectorize; it is given to the compile step only, since
# linking a shared library with it would set flush-to-zero for the whole process (gcc < 13).
_COMPILE_FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-std=c11")
_LINK_FLAGS = ("-shared", "-fopenmp", "-lm")

logger = logging.getLogger(__name__)

__all__ = ["bind", "native_library", "use_cache_dir"]

_directory = Path(tempfile.gettempdir()) / f"triode-kernels-{os.getuid()}"


def use_cache_dir(cache_dir: str | Path) -> None:
    """Builds into ``cache_dir/kernels`` from now on (a library already loaded stays)."""
    global _directory
    _directory = Path(cache_dir) / "kernels"


def _build(compiler: str) -> Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    files = (path.read_text() for path in (*_SOURCES, *_HEADERS))
    text = "\0".join([*files, *_COMPILE_FLAGS, *_LINK_FLAGS, version])
    library = _directory / f"triode-kernels-{hashlib.sha256(text.encode()).hexdigest()[:16]}.so"
    if library.exists():
        return library
    library.parent.mkdir(parents=True, exist_ok=True)
    # Built in a private directory and renamed into place: concurrent workers never load a
    # half-written library.
    with tempfile.TemporaryDirectory(dir=library.parent) as scratch:
        objects = [str(Path(scratch) / f"{source.stem}.o") for source in _SOURCES]
        built = Path(scratch) / library.name
        _run_all([[compiler, *_COMPILE_FLAGS, "-c", str(source), "-o", obj]
                  for source, obj in zip(_SOURCES, objects, strict=True)])
        _run_all([[compiler, *objects, *_LINK_FLAGS, "-o", str(built)]])
        os.replace(built, library)
    return library


def _run_all(commands: list[list[str]]) -> None:
    """Runs the commands side by side (the decode kernels' units take seconds each); raises
    with the first failure's command and error output once all have finished."""
    processes = [(command, subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
                 for command in commands]
    failures = []
    for command, process in processes:
        _, errors = process.communicate()
        if process.returncode:
            failures.append(f"{' '.join(command)} failed: {errors.strip()[-2000:]}")
    if failures:
        raise RuntimeError(failures[0])


@functools.cache
def native_library() -> ctypes.CDLL | None:
    """The loaded library, built first if needed; None (logged once) when it cannot be."""
    try:
        return ctypes.CDLL(str(_build(os.environ.get("CC") or "cc")))
    except (OSError, RuntimeError, subprocess.CalledProcessError) as error:
        logger.warning("triode's C kernels are unavailable, using the torch references: %s", error)
        return None


def bind(name: str, *argtypes) -> ctypes._CFuncPtr | None:
    """The library's function ``name`` returning int, with ``argtypes``; None without it."""
    library = native_library()
    if library is None:
        return None
    function = getattr(library, name)
    function.restype = ctypes.c_int
    function.argtypes = list(argtypes)
    return function
