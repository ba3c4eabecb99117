"""triode's C kernels for CPUs (``csrc/*.c``): built on first use, loaded with ctypes.

The sources are compiled with the system C compiler (``$CC``, else ``cc``) for this CPU
(``-march=native``) into one shared library under ``<cache>/kernels/`` (the engine's cache
directory, given by :func:`use_cache_dir`; a per-user temporary directory when no engine set
it), named by a hash of the sources, the flags and the compiler, so every start after the
first costs a ``dlopen``.
Without a compiler (or if the build fails) :func:`native_library` returns None, the reason
is logged once, and the ops take their torch references. ``TRIODE_CPU_ISA=avx2`` (or
:func:`set_cpu_isa`) builds and loads the library for AVX2 (``-march=x86-64-v3``) instead of
this CPU's widest vectors, so that the AVX2 code paths run, and are tested, on an AVX-512
machine too; ``avx2-vnni`` adds AVX-VNNI (``vpdpbusd`` on 8 lanes, as Intel's cores from Alder
Lake and its E-core Xeons have without AVX-512), for a CPU that has it. The library links the
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
_COMPILE_FLAGS = ("-O3", "-ffast-math", "-fopenmp", "-fPIC", "-std=c11")
ISA_FLAGS = {"native": ("-march=native",), "avx2": ("-march=x86-64-v3", "-mtune=native"),
             "avx2-vnni": ("-march=x86-64-v3", "-mavxvnni", "-mtune=native")}
_LINK_FLAGS = ("-shared", "-fopenmp", "-lm")

logger = logging.getLogger(__name__)

__all__ = ["ISA_FLAGS", "bind", "cpu_isa", "native_library", "set_cpu_isa", "use_cache_dir"]

_directory = Path(tempfile.gettempdir()) / f"triode-kernels-{os.getuid()}"
_isa = os.environ.get("TRIODE_CPU_ISA", "native")


def set_cpu_isa(name: str) -> None:
    """Which build later calls bind: 'native' (this CPU's instructions), 'avx2' or
    'avx2-vnni'."""
    global _isa
    if name not in ISA_FLAGS:
        raise ValueError(f"CPU ISA must be one of {', '.join(ISA_FLAGS)}; got {name!r}")
    _isa = name


def cpu_isa() -> str:
    if _isa not in ISA_FLAGS:
        raise ValueError(f"TRIODE_CPU_ISA must be one of {', '.join(ISA_FLAGS)}; got {_isa!r}")
    return _isa


def use_cache_dir(cache_dir: str | Path) -> None:
    """Builds into ``cache_dir/kernels`` from now on (a library already loaded stays)."""
    global _directory
    _directory = Path(cache_dir) / "kernels"


@functools.cache
def _cpu_identity() -> str:
    """This CPU's model and instruction-set flags: -march=native builds for them, so a cache
    shared by machines of different CPUs (a volume under several nodes) keeps one library each."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return ""
    wanted = ("model name", "flags")
    return "\n".join(next((line for line in lines if line.startswith(key)), "") for key in wanted)


def _build(compiler: str, isa: str) -> Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    files = (path.read_text() for path in (*_SOURCES, *_HEADERS))
    compile_flags = (*_COMPILE_FLAGS, *ISA_FLAGS[isa])
    text = "\0".join([*files, *compile_flags, *_LINK_FLAGS, version, _cpu_identity()])
    library = _directory / f"triode-kernels-{hashlib.sha256(text.encode()).hexdigest()[:16]}.so"
    if library.exists():
        return library
    library.parent.mkdir(parents=True, exist_ok=True)
    # Built in a private directory and renamed into place: concurrent workers never load a
    # half-written library.
    with tempfile.TemporaryDirectory(dir=library.parent) as scratch:
        objects = [str(Path(scratch) / f"{source.stem}.o") for source in _SOURCES]
        built = Path(scratch) / library.name
        _run_all([[compiler, *compile_flags, "-c", str(source), "-o", obj]
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


def native_library() -> ctypes.CDLL | None:
    """The loaded library for :func:`cpu_isa`, built first if needed; None (logged once) when
    it cannot be."""
    return _library(cpu_isa())


@functools.cache
def _library(isa: str) -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(str(_build(os.environ.get("CC") or "cc", isa)))
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
