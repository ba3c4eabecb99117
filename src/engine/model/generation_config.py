"""What a model says about generating with it: every end-of-sequence id, and sampling defaults.

Hugging Face's ``generate`` and vLLM stop on every id listed as ``eos_token_id`` (an int or a
list) in config.json and in generation_config.json: Llama 3.x Instruct lists three in
config.json and ends each turn with the last, ``<|eot_id|>``; Qwen2.5 puts its turn end in
generation_config.json only. The tokenizer's own end-of-sequence token comes first: vLLM
reports ``stop_reason`` None for that one and the id for the others, and so does triode.

generation_config.json may also carry sampling defaults (``temperature``, ``top_p``,
``top_k``, ``min_p``, ``repetition_penalty``). As vLLM's ``--generation-config auto`` does,
they apply where a request leaves the field unset: a server request without it, or a Python
call without SamplingParams. ``vllm`` turns them off (the end-of-sequence ids still apply:
they are about where a model's answer ends, not about taste); a folder path reads that
folder's generation_config.json instead of the model's.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import attrs

from triode.engine.errors import InvalidRequestError, ModelLoadError
from triode.engine.sampling_params import SamplingParams

GENERATION_CONFIG_FILE = "generation_config.json"
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
_INTEGER_FIELDS = frozenset({"top_k"})


@attrs.frozen(kw_only=True)
class GenerationDefaults:
    eos_token_ids: tuple[int, ...]  # the tokenizer's own first
    sampling: tuple[tuple[str, float | int], ...] = ()  # (field, value) of SAMPLING_FIELDS
    source: str | None = None  # the generation_config.json the sampling defaults came from

    def sampling_params(self, **fields: Any) -> SamplingParams:
        """SamplingParams with these defaults under the given fields (vLLM's defaults
        elsewhere)."""
        return SamplingParams(**{**dict(self.sampling), **fields})

    def describe(self) -> str:
        """One line for the start-up log."""
        sampling = ", ".join(f"{name}={value}" for name, value in self.sampling)
        where = f" from {self.source}" if self.source else ""
        return (f"end-of-sequence ids {list(self.eos_token_ids)}; sampling defaults"
                f"{where}: {sampling or 'none (vLLM defaults)'}")


def _read(file: Path) -> dict[str, Any] | None:
    if not file.is_file():
        return None
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"cannot read it: {e}", path=str(file)) from e
    if not isinstance(raw, dict):
        raise ModelLoadError("expected a JSON object", path=str(file))
    return raw


def _eos_ids(raw: dict[str, Any] | None, file: Path) -> list[int]:
    value = (raw or {}).get("eos_token_id")
    if value is None:
        return []
    ids = value if isinstance(value, list) else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ModelLoadError(f"eos_token_id must be a token id or a list of them, got {value!r}",
                             path=str(file))
    return ids


def _sampling(raw: dict[str, Any], file: Path) -> tuple[tuple[str, float | int], ...]:
    found: list[tuple[str, float | int]] = []
    for name in SAMPLING_FIELDS:
        value = raw.get(name)
        if value is None:
            continue
        kind = int if name in _INTEGER_FIELDS else float
        if (isinstance(value, bool) or not isinstance(value, int | float)
                or (kind is int and not float(value).is_integer()) or not math.isfinite(value)):
            raise ModelLoadError(f"{name} must be a number, got {value!r}", path=str(file))
        found.append((name, kind(value)))
    try:
        SamplingParams(**dict(found))
    except InvalidRequestError as e:
        raise ModelLoadError(f"an invalid sampling default: {e}", path=str(file)) from None
    return tuple(found)


def read_generation_defaults(
    model_path: str | Path, *, mode: str = "auto", tokenizer_eos_token_id: int | None = None
) -> GenerationDefaults:
    """``mode``: "auto" (the model's generation_config.json), "vllm" (no sampling defaults)
    or a folder holding a generation_config.json. A file that is not valid JSON, or whose
    values are not what Hugging Face defines, raises ``ModelLoadError`` naming it."""
    model_dir = Path(model_path)
    config_file = model_dir / "config.json"
    if mode in ("auto", "vllm"):
        generation_file = model_dir / GENERATION_CONFIG_FILE
    else:
        generation_file = Path(mode).expanduser() / GENERATION_CONFIG_FILE
        if not generation_file.is_file():
            raise ModelLoadError(f"--generation-config names a folder without {GENERATION_CONFIG_FILE}",
                                 path=str(generation_file.parent))
    generation = _read(generation_file)
    ids = [] if tokenizer_eos_token_id is None else [tokenizer_eos_token_id]
    ids += _eos_ids(_read(config_file), config_file) + _eos_ids(generation, generation_file)
    sampling = () if mode == "vllm" or generation is None else _sampling(generation, generation_file)
    return GenerationDefaults(
        eos_token_ids=tuple(dict.fromkeys(ids)),
        sampling=sampling,
        source=str(generation_file) if sampling else None,
    )
