"""The one model resolver: turns what the user asked for into a local Hugging Face directory.

Every entry point goes through :func:`resolve_model`, so a model given as a local directory,
a ``.gguf`` file, a hub id or nothing at all (the default model) reaches the model code in
one layout: ``config.json`` plus safetensors (single file or sharded) plus tokenizer files.
GGUF files are converted once into the triode cache (:mod:`triode.engine.model_files.cache`), their
quantized weights kept as they are (:mod:`triode.engine.model_files.gguf_convert`); with
``--quantization``, a float checkpoint is quantized once into the cache the same way
(:mod:`triode.engine.model_files.quantize`);
directories are checked by :mod:`triode.engine.model_files.layout` before anything loads them.

It runs in the engine process (the workers are handed the resolved directory), and in a
follower process on another node.
"""

from __future__ import annotations

import contextlib
import hashlib
import re
import shutil
from pathlib import Path
from typing import Any

import attrs

from triode.engine.errors import InvalidRequestError, ModelLoadError
from triode.engine.model_files.cache import ensure_cache_entry
from triode.engine.model_files.default_model import (
    DEFAULT_MODEL_NAME,
    fetch_default_gguf,
    installed_default_gguf,
    say,
)
from triode.engine.model_files.gguf_convert import convert_gguf
from triode.engine.model_files.layout import validate_hf_dir
from triode.engine.model_files.quantize import check_quantizable, quantize_checkpoint

_HUB_ID = re.compile(r"^(?:[A-Za-z0-9][\w.-]*/)?[A-Za-z0-9][\w.-]*$")
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer.model", "*.tiktoken",
                 "merges.txt", "vocab.txt"]
# consolidated.safetensors duplicates the sharded weights in Mistral repos; subfolders hold
# other formats (onnx/, original/).
_HUB_IGNORE = ["consolidated*", "*/*"]
_HUB_PROBE_TIMEOUT_S = 5.0
# Part of every GGUF cache entry's name: a converter that writes another layout bumps it, so an
# entry written by an older one is never read as this one's.
GGUF_LAYOUT = "q2"
QUANTIZED_LAYOUT = "q1"  # the same for entries of --quantization


@attrs.frozen
class ResolvedModel:
    """A local Hugging Face-format model directory and what the user asked for to get it."""

    path: Path
    source: str


def resolve_model(model: str | None, *, cache_dir: str, progress: bool = True,
                  quantization: str | None = None) -> ResolvedModel:
    """Resolves a local directory, a ``.gguf`` file, a hub id, or None/"default" (SmolLM2);
    with ``quantization``, to the cache entry of that checkpoint quantized."""
    resolved = _resolve(model, cache_dir, progress)
    if quantization is None:
        return resolved
    if resolved.source == "default" or Path(resolved.source).suffix.lower() == ".gguf":
        raise InvalidRequestError("quantization: the model is a GGUF file, already quantized; "
                                  "run it without --quantization", field="quantization")
    return ResolvedModel(path=_quantized(resolved.path, quantization, cache_dir, progress),
                         source=resolved.source)


def _resolve(model: str | None, cache_dir: str, progress: bool) -> ResolvedModel:
    if model is None or model == "default":
        path = ensure_cache_entry(
            Path(cache_dir) / "models", f"{DEFAULT_MODEL_NAME}-{GGUF_LAYOUT}", _build_default,
            progress=progress,
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
    # The source file stays beside the conversion (98 MB): transformers reads it with
    # gguf_file=, the reference that the tests hold the quantized model to.
    shutil.copyfile(gguf_path, out / gguf_path.name)


def _resolve_gguf(path: Path, cache_dir: str, progress: bool) -> Path:
    path = path.resolve()
    stat = path.stat()
    # Keyed by identity and version of the file: an edited or replaced GGUF gets a new entry
    # without hashing gigabytes on every start.
    key = hashlib.sha256(f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}\0{GGUF_LAYOUT}".encode()).hexdigest()
    stem = re.sub(r"[^\w.-]+", "_", path.stem)[:80]

    def build(out: Path, scratch: Path, progress: bool) -> None:
        convert_gguf(path, out, scratch, progress=progress)

    return ensure_cache_entry(
        Path(cache_dir) / "models", f"gguf-{stem}-{key[:16]}", build, progress=progress
    )


def _quantized(path: Path, quantization: str, cache_dir: str, progress: bool) -> Path:
    check_quantizable(path, quantization)
    # Keyed by the checkpoint files' identities and versions, like a GGUF entry.
    identity = [f"{path.resolve()}", quantization, QUANTIZED_LAYOUT]
    for file in sorted(path.iterdir()):
        if file.is_file():
            stat = file.stat()
            identity.append(f"{file.name}:{stat.st_size}:{stat.st_mtime_ns}")
    key = hashlib.sha256("\0".join(identity).encode()).hexdigest()
    stem = re.sub(r"[^\w.-]+", "_", path.name)[:80]

    def build(out: Path, scratch: Path, progress: bool) -> None:
        quantize_checkpoint(path, out, quantization, progress=progress)

    return ensure_cache_entry(
        Path(cache_dir) / "models", f"{quantization}-{stem}-{key[:16]}", build, progress=progress
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
