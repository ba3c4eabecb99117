"""llama.cpp's own server, the C++ ``llama-server``, for ``triode bench serve --peer llama.cpp``.

It is built once from the llama.cpp sources that the ``llama-cpp-python`` sdist vendors
(pinned, so that every machine compares against the same llama.cpp): CMake with
``GGML_NATIVE=ON`` (``-march=native``), target ``llama-server`` only, into the triode cache,
never into triode's environment (about 10 minutes on 2 cores; the compile's progress is
shown, its output goes to a log). It is started with continuous batching, one slot per
concurrent client, every slot holding ``--max-model-len`` tokens, and every core.

On a CPU with AMX the vendored sources get one fix before the build (``fix_amx_tile_config``):
as shipped, GCC drops the tile configuration that llama.cpp's AMX matmuls load, and the first
request dies of an illegal instruction; fixed, llama.cpp runs its own AMX kernels, its fastest
on such a CPU.

(llama-cpp-python's own server, which earlier comparisons used, runs one request at a time:
its figures are not llama.cpp's.)
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import TextIO

from triode.bench.peer_build import PeerUnavailable, run_logged
from triode.bench.report import cpu_fields

LLAMA_CPP_SDIST = "llama-cpp-python==0.3.36"
_READY_TIMEOUT_S = 600.0


def ensure_llama_server(cache_dir: Path, log: Path, cpuinfo: Path = Path("/proc/cpuinfo")) -> Path:
    """The ``llama-server`` binary, built on first use (raises PeerUnavailable)."""
    amx = cpu_reports_amx(cpuinfo)
    home = cache_dir / "peers" / ("llama-server-" + LLAMA_CPP_SDIST.split("==")[1] + ("-amx-fixed" if amx else ""))
    binary = home / "build" / "bin" / "llama-server"
    if binary.exists() and _answers_version(binary):
        return binary
    missing = [tool for tool, found in (("CMake", shutil.which("cmake")), ("a C++ compiler", _cxx()))
               if found is None]
    if missing:
        raise PeerUnavailable(f"building llama.cpp's llama-server needs {' and '.join(missing)}, not found on PATH "
                              "(on Debian or Ubuntu: apt install cmake g++)")
    log.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(home, ignore_errors=True)
    home.mkdir(parents=True)
    print(f"building llama.cpp's llama-server from the {LLAMA_CPP_SDIST} sdist into {home} (once; about 10 "
          f"minutes on 2 cores; log: {log})", flush=True)
    with log.open("w") as out, tempfile.TemporaryDirectory(prefix="llama-cpp-sdist-") as scratch:
        source = _vendored_sources(Path(scratch), out)
        if amx:
            fix_amx_tile_config(source, out)
        configure = ["cmake", "-S", str(source), "-B", str(home / "build"), "-DCMAKE_BUILD_TYPE=Release",
                     "-DGGML_NATIVE=ON", "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_TESTS=OFF",
                     "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
                     # The web UI would be fetched from the network; the API needs none of it.
                     "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF"]
        run_logged(configure, out, "configuring llama.cpp (CMake)")
        build = ["cmake", "--build", str(home / "build"), "--target", "llama-server", "-j", str(os.cpu_count() or 1)]
        run_logged(build, out, "compiling llama-server", progress="percent")
    if not binary.exists():
        raise PeerUnavailable(f"the llama.cpp build produced no {binary}; see {log}")
    return binary


def _answers_version(binary: Path) -> bool:
    try:
        return subprocess.run([str(binary), "--version"], capture_output=True, timeout=30).returncode == 0
    except subprocess.TimeoutExpired:
        return False


def cpu_reports_amx(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    return "amx_tile" in cpu_fields(cpuinfo).get("flags", "").split()


def llama_server_description(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """What ``ensure_llama_server`` builds on this CPU, in words, for the benchmark's report."""
    fixed = ", with its AMX kernels (their tile configuration fixed)" if cpu_reports_amx(cpuinfo) else ""
    return f"llama-server from the {LLAMA_CPP_SDIST} sdist{fixed}"


# In ggml_tile_config_init (ggml-cpu/amx/mmq.cpp) the configuration is filled in on the stack
# and handed to _tile_loadconfig. GCC does not count ldtilecfg as reading it, so it keeps the
# zeroing and the palette byte and drops every row and column count: the tiles come up
# unconfigured and the next tile instruction faults (an illegal instruction at tilezero on an
# Emerald Rapids Xeon; the general protection fault at ldtilecfg seen on an earlier Xeon was
# likely the same dropped stores; llama.cpp pull request 26954, open, reports them). A
# compiler barrier before the load keeps the stores.
_TILE_CONFIG_LOAD = "    _tile_loadconfig(&tc);\n"
_TILE_CONFIG_BARRIER = ('    __asm__ __volatile__("" : : "r"(&tc) : "memory");  '
                        "// triode: keep tc's stores (GCC drops them before ldtilecfg)\n")


def fix_amx_tile_config(source: Path, out: TextIO) -> bool:
    """Puts the barrier before llama.cpp's tile configuration load in the sources at
    ``source``; False (and a line in the log ``out``) where the load is not found as expected,
    which a llama.cpp that fixed it another way would not have."""
    path = source / "ggml" / "src" / "ggml-cpu" / "amx" / "mmq.cpp"
    text = path.read_text() if path.exists() else ""
    if text.count(_TILE_CONFIG_LOAD) != 1:
        out.write(f"triode: the AMX tile configuration fix does not apply to {path}; building it as it is\n")
        return False
    path.write_text(text.replace(_TILE_CONFIG_LOAD, _TILE_CONFIG_BARRIER + _TILE_CONFIG_LOAD))
    out.write(f"triode: fixed the AMX tile configuration load in {path}\n")
    return True


def start_llama_server(binary: Path, gguf_path: Path, *, slots: int, slot_tokens: int, threads: int, port: int,
                       log_path: Path) -> subprocess.Popen:
    """Starts the server and returns once it has loaded the model (raises PeerUnavailable)."""
    command = [str(binary), "--model", str(gguf_path), "--host", "127.0.0.1", "--port", str(port),
               "--parallel", str(slots), "--ctx-size", str(slots * slot_tokens), "--cont-batching",
               "--threads", str(threads), "--threads-batch", str(threads), "--no-webui"]
    print(f"starting llama-server with {slots} slots of {slot_tokens} tokens (log: {log_path}) ...", flush=True)
    with log_path.open("w") as log:  # the server writes to its own copy of the descriptor
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + _READY_TIMEOUT_S
    try:
        while process.poll() is None and time.monotonic() < deadline:
            try:  # 503 while the model loads, 200 once it serves
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
                    if response.status == 200:
                        return process
            except OSError:
                pass
            time.sleep(0.5)
    except BaseException:  # Ctrl-C while it loads: the caller never got the process to stop
        process.kill()
        process.wait()
        raise
    timed_out = process.poll() is None
    process.kill()
    process.wait()
    if timed_out:
        raise PeerUnavailable(f"llama-server did not answer /health within {_READY_TIMEOUT_S:.0f} s (stopped); "
                              f"see {log_path}")
    raise PeerUnavailable(f"llama-server did not start (exit code {process.returncode}); see {log_path}")


def _vendored_sources(scratch: Path, out) -> Path:
    run_logged([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--dest", str(scratch),
             LLAMA_CPP_SDIST], out, f"downloading the {LLAMA_CPP_SDIST} sdist")
    archive = next(scratch.glob("*.tar.gz"))
    with tarfile.open(archive) as sdist:
        members = [m for m in sdist.getmembers() if "/vendor/llama.cpp/" in m.name]
        sdist.extractall(scratch, members=members, filter="data")
    return next(scratch.glob("*/vendor/llama.cpp"))


def _cxx() -> str | None:
    candidates = [os.environ["CXX"]] if os.environ.get("CXX") else ["c++", "g++", "clang++"]
    return next((found for name in candidates if (found := shutil.which(name))), None)
