"""Which runner a model gets and how a pooling model pools, decided as vLLM decides them,
from the model's files alone (no torch: the engine and the workers both read it).

- ``runner``: ``generate`` for a ``*ForCausalLM`` checkpoint, ``pooling`` for a bare
  decoder (``Qwen3Model``, ``Qwen2Model``, ``LlamaModel``, ``MistralModel``: vLLM's ``*Model``
  rule) and for the encoders ``BertModel`` and ``XLMRobertaModel``; ``--runner pooling`` on
  a causal LM converts it (``--convert embed``: its LM head is dropped).
- pooling: ``--pooler-config`` if given, else sentence-transformers' ``modules.json`` (its
  Pooling module's ``config.json``: CLS, mean or last token; a Normalize module), else the
  last token (a decoder's) or CLS (an encoder's), normalized, as vLLM defaults them."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from triode.engine.errors import InvalidRequestError, UnsupportedModelError
from triode.engine.json_options import from_json_object

RUNNERS = ("auto", "generate", "pooling")
CONVERTS = ("auto", "none", "embed")
POOLING_TYPES = ("LAST", "MEAN", "CLS")
# A bare decoder checkpoint (no LM head, tensors without "model.") -> the causal architecture
# whose layers it has.
BASE_MODELS = {"LlamaModel": "LlamaForCausalLM", "MistralModel": "MistralForCausalLM",
               "Qwen2Model": "Qwen2ForCausalLM", "Qwen3Model": "Qwen3ForCausalLM"}
# Encoders (bidirectional attention over a whole prompt): pooling models only.
ENCODERS = ("BertModel", "XLMRobertaModel")
_ST_MODES = {"pooling_mode_cls_token": "CLS", "pooling_mode_mean_tokens": "MEAN",
             "pooling_mode_lasttoken": "LAST"}


@attrs.frozen(kw_only=True)
class PoolerConfig:
    pooling_type: str = attrs.field(default="LAST", converter=lambda v: v.upper() if isinstance(v, str) else v)
    normalize: bool = True

    def __attrs_post_init__(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            raise InvalidRequestError(f"pooler_config.pooling_type: expected one of {', '.join(POOLING_TYPES)}, "
                                      f"got {self.pooling_type!r}", field="pooler_config")
        if not isinstance(self.normalize, bool):
            raise InvalidRequestError(f"pooler_config.normalize: expected true or false, got {self.normalize!r}",
                                      field="pooler_config")


def pooler_config(value: PoolerConfig | Mapping[str, Any] | str | None) -> PoolerConfig | None:
    """``--pooler-config``: a JSON object (``{"pooling_type": "MEAN", "normalize": false}``)."""
    return from_json_object(PoolerConfig, value, "pooler_config")


def resolve_runner(architectures: Sequence[str], *, runner: str = "auto", convert: str = "auto",
                   source: str = "config.json") -> str:
    """``generate`` or ``pooling`` for a checkpoint of ``architectures``."""
    base = any(a in BASE_MODELS or a in ENCODERS for a in architectures)
    if runner == "generate" and base:
        raise UnsupportedModelError(f"{architectures[0]} has no language-model head: it runs only as "
                                    "--runner pooling", path=source)
    if runner == "pooling" or base:
        if convert == "none" and not base:
            raise UnsupportedModelError(f"{architectures[0]} is a generation model: --runner pooling needs "
                                        "--convert embed (or auto)", path=source)
        return "pooling"
    if convert == "embed":
        return "pooling"
    return "generate"


def read_pooler_config(model_path: str | Path, given: PoolerConfig | None, *, encoder: bool = False) -> PoolerConfig:
    """The pooling of a pooling model: ``given``, else sentence-transformers' files, else
    the last token (a decoder's) or the first (an encoder's CLS), normalized."""
    if given is not None:
        return given
    path = Path(model_path)
    default = "CLS" if encoder else "LAST"
    modules = _json(path / "modules.json")
    if not isinstance(modules, list):
        return PoolerConfig(pooling_type=default)
    kinds = {str(m.get("type", "")).rsplit(".", 1)[-1]: m for m in modules if isinstance(m, dict)}
    if unknown := sorted(set(kinds) - {"Transformer", "Pooling", "Normalize"}):
        raise UnsupportedModelError(f"sentence-transformers module {unknown[0]} is not supported (Transformer, "
                                    "Pooling and Normalize are)", path=str(path))
    pooling_type = default
    if "Pooling" in kinds:
        config = _json(path / kinds["Pooling"].get("path", "") / "config.json") or {}
        modes = [mode for key, mode in _ST_MODES.items() if config.get(key)]
        if len(modes) != 1 or config.get("include_prompt", True) is not True:
            raise UnsupportedModelError(f"sentence-transformers pooling {sorted(k for k in config if config[k])} "
                                        "is not supported (one of CLS, mean or last token)", path=str(path))
        pooling_type = modes[0]
    return PoolerConfig(pooling_type=pooling_type, normalize="Normalize" in kinds)


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
