"""A PEFT LoRA adapter's files, read and checked against the served model without loading a
tensor: ``adapter_config.json`` and the safetensors header of ``adapter_model.safetensors``.

The engine process runs these checks before it accepts an adapter (at start-up for
``--lora-modules``, on ``/v1/load_lora_adapter``, on a request's first use of a
``LoRARequest``), so a wrong adapter is a clear error naming it and the reason, never a worker
crash; the workers read the same :class:`AdapterFacts` to know which tensor goes where (and
refuse weights that are not finite once scaled, ending the adapter's requests).

triode applies adapters to the attention projections (q, k, v, o) and the MLP's (gate, up,
down) of every decoder layer, which is what PEFT's LoRA adapters for the Llama, Qwen, Mistral
and Gemma families target. Scaling is ``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with
``use_rslora``. Refused with the reason: DoRA, trained biases, ``modules_to_save``, per-module
``rank_pattern``/``alpha_pattern``, ``fan_in_fan_out`` (GPT-2's Conv1D layout), adapters of
other layers (embeddings, the LM head, experts of a mixture), and pickled ``.bin`` weights.
"""

from __future__ import annotations

import json
import math
import re
import struct
from pathlib import Path
from typing import Any

import attrs

from triode.engine import json_nesting
from triode.engine.errors import InvalidRequestError
from triode.engine.model.config import ModelConfig

__all__ = ["TARGET_MODULES", "AdapterFacts", "LoRAAdapterError", "module_shape", "read_adapter"]

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_DTYPES = {"F32": 4, "F16": 2, "BF16": 2}
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


class LoRAAdapterError(InvalidRequestError):
    """An adapter that cannot be served; the message names it and the reason."""

    def __init__(self, adapter: str, reason: str) -> None:
        super().__init__(f"LoRA adapter {adapter!r}: {reason}", field="lora_request")
        self.adapter = adapter


@attrs.frozen(kw_only=True)
class AdapterFacts:
    """What an adapter holds: its rank, its scaling, and for each (layer, module) it targets
    the names of its A [rank, in] and B [out, rank] tensors in ``weights_file``."""

    name: str
    weights_file: Path
    rank: int
    scaling: float
    targets: dict[tuple[int, str], tuple[str, str]]


def module_shape(config: ModelConfig, module: str) -> tuple[int, int]:
    """(in_features, out_features) of a target module of ``config``'s decoder layers."""
    attention = config.num_heads * config.head_dim
    kv = config.num_kv_heads * config.head_dim
    hidden, intermediate = config.hidden_size, config.intermediate_size
    return {
        "q_proj": (hidden, attention), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
        "o_proj": (attention, hidden), "gate_proj": (hidden, intermediate),
        "up_proj": (hidden, intermediate), "down_proj": (intermediate, hidden),
    }[module]


def _read_json(path: Path, name: str) -> dict[str, Any]:
    try:
        value = json_nesting.loads(path.read_text())
    except FileNotFoundError:
        raise LoRAAdapterError(name, f"{path} is missing") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise LoRAAdapterError(name, f"{path} is not readable JSON ({error})") from None
    if not isinstance(value, dict):
        raise LoRAAdapterError(name, f"{path} is not a JSON object")
    return value


def _safetensors_header(path: Path, name: str) -> dict[str, Any]:
    """The header of a safetensors file, after checking that the file holds every tensor it names."""
    try:
        with path.open("rb") as file:
            size = path.stat().st_size
            prefix = file.read(8)
            if len(prefix) < 8:
                raise LoRAAdapterError(name, f"{path} is truncated ({size} bytes)")
            (length,) = struct.unpack("<Q", prefix)
            if length > size - 8:
                raise LoRAAdapterError(name, f"{path} is truncated: its header claims {length} bytes, "
                                             f"the file has {size}")
            header = json_nesting.loads(file.read(length))
    except FileNotFoundError:
        raise LoRAAdapterError(name, f"{path} is missing") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise LoRAAdapterError(name, f"{path} is not a safetensors file ({error})") from None
    if not isinstance(header, dict):
        raise LoRAAdapterError(name, f"{path} is not a safetensors file")
    header.pop("__metadata__", None)
    data = size - 8 - length
    for key, info in header.items():
        if not _tensor_entry(info):
            raise LoRAAdapterError(name, f"{path}: tensor {key!r} is not described as safetensors describes "
                                         f"one (dtype F32, F16 or BF16, shape, data_offsets)")
        shape, (start, end) = info["shape"], info["data_offsets"]
        if end - start != math.prod(shape) * _DTYPES[info["dtype"]]:
            raise LoRAAdapterError(name, f"{path}: tensor {key!r} of shape {shape} does not fit its data_offsets "
                                         f"{info['data_offsets']}")
        if end > data:
            raise LoRAAdapterError(name, f"{path} is truncated: tensor {key!r} ends at byte {8 + length + end}, "
                                         f"the file has {size}")
    # safetensors' own reader (the workers') also wants the tensors end to end, filling the file
    covered = 0
    for start, end in sorted(tuple(info["data_offsets"]) for info in header.values()):
        if start != covered:
            raise LoRAAdapterError(name, f"{path} is not a safetensors file: its tensors' data_offsets "
                                         f"{'overlap' if start < covered else 'leave a gap'} at byte {covered}")
        covered = end
    if covered != data:
        raise LoRAAdapterError(name, f"{path} is not a safetensors file: {data - covered} bytes follow its "
                                     f"last tensor")
    return header


def _tensor_entry(info: object) -> bool:
    """Whether a header entry describes a tensor: a dtype triode reads, a shape and two offsets."""
    def naturals(value: object) -> bool:
        return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                                                for v in value)

    return (isinstance(info, dict) and info.get("dtype") in _DTYPES and naturals(info.get("shape"))
            and naturals(info.get("data_offsets")) and len(info["data_offsets"]) == 2)


def _check_config(config: dict[str, Any], name: str, max_rank: int) -> tuple[int, float]:
    """The adapter's rank and scaling, after refusing what triode does not apply."""
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise LoRAAdapterError(name, f"peft_type {config.get('peft_type')!r} is not LORA")
    unsupported = {
        "use_dora": config.get("use_dora"), "modules_to_save": config.get("modules_to_save"),
        "rank_pattern": config.get("rank_pattern"), "alpha_pattern": config.get("alpha_pattern"),
        "fan_in_fan_out": config.get("fan_in_fan_out"),
    }
    for option, value in unsupported.items():
        if value:
            raise LoRAAdapterError(name, f"{option}={value!r} is not supported")
    if config.get("bias", "none") != "none":
        raise LoRAAdapterError(name, f"bias={config['bias']!r} is not supported (only 'none')")
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise LoRAAdapterError(name, f"r must be a positive int, got {rank!r}")
    if rank > max_rank:
        raise LoRAAdapterError(name, f"its rank {rank} exceeds --max-lora-rank {max_rank}")
    if alpha is None:
        alpha = 8  # PEFT's default
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not math.isfinite(alpha):
        raise LoRAAdapterError(name, f"lora_alpha must be a finite number, got {alpha!r}")
    rslora = config.get("use_rslora") or False
    if not isinstance(rslora, bool):  # the string "false" once read as true
        raise LoRAAdapterError(name, f"use_rslora must be true or false, got {rslora!r}")
    scaling = alpha / math.sqrt(rank) if rslora else alpha / rank
    return rank, float(scaling)


def read_adapter(path: str | Path, name: str, model: ModelConfig, *, max_rank: int) -> AdapterFacts:
    """The facts of the adapter in directory ``path``, checked against ``model`` (raises
    ``LoRAAdapterError`` naming ``name`` and the reason)."""
    directory = Path(path).expanduser()
    if not directory.is_dir():
        raise LoRAAdapterError(name, f"{directory} is not a directory (LoRA adapters are directories "
                                     f"with {CONFIG_FILE} and {WEIGHTS_FILE})")
    rank, scaling = _check_config(_read_json(directory / CONFIG_FILE, name), name, max_rank)
    weights = directory / WEIGHTS_FILE
    if not weights.exists() and (directory / "adapter_model.bin").exists():
        raise LoRAAdapterError(name, f"adapter_model.bin (pickled weights) is not read: save the adapter "
                                     f"as {WEIGHTS_FILE} (PEFT's default, safe_serialization=True)")
    header = _safetensors_header(weights, name)
    parts: dict[tuple[int, str], dict[str, str]] = {}
    for key, info in header.items():
        match = _KEY.search(key)
        if match is None:
            raise LoRAAdapterError(name, f"tensor {key!r} adapts a layer triode does not (it applies adapters to "
                                         f"{', '.join(TARGET_MODULES)} of the decoder layers)")
        layer, module, side = int(match[1]), match[2], match[3]
        if module not in TARGET_MODULES:
            raise LoRAAdapterError(name, f"target module {module!r} is not one the model has (it has "
                                         f"{', '.join(TARGET_MODULES)})")
        if layer >= model.num_layers:
            raise LoRAAdapterError(name, f"it adapts layer {layer}, but the model has {model.num_layers} layers "
                                         f"(an adapter of another base model?)")
        if module in ("gate_proj", "up_proj", "down_proj") and model.layer_is_moe(layer):
            raise LoRAAdapterError(name, f"it adapts {module} of layer {layer}, a mixture-of-experts layer "
                                         f"(adapters of experts are not supported)")
        in_features, out_features = module_shape(model, module)
        expected = [rank, in_features] if side == "A" else [out_features, rank]
        if info["shape"] != expected:
            raise LoRAAdapterError(name, f"tensor {key!r} has shape {info.get('shape')}, this model needs "
                                         f"{expected} (an adapter of another base model, or of another rank "
                                         f"than its r={rank}?)")
        parts.setdefault((layer, module), {})[side] = key
    if not parts:
        raise LoRAAdapterError(name, f"{weights} holds no LoRA tensors")
    targets = {}
    for (layer, module), sides in sorted(parts.items()):
        if set(sides) != {"A", "B"}:
            raise LoRAAdapterError(name, f"{module} of layer {layer} has lora_{''.join(sides)} without its pair")
        targets[layer, module] = (sides["A"], sides["B"])
    return AdapterFacts(name=name, weights_file=weights, rank=rank, scaling=scaling, targets=targets)
