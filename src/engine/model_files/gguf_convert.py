"""GGUF files into the triode cache, quantized weights kept as they are.

The config and tokenizer are read from the GGUF metadata by transformers (which reads no
tensor data for them). The tensors are ours: each is renamed to its Hugging Face name, the
q/k rows of a ``llama`` file are put back from llama.cpp's rotary order, a Gemma file's norms
from the (1 + w) llama.cpp stores to transformers' w, and the result is streamed into one
safetensors file. Tensors of a block type the CPU kernels run
(:data:`KERNEL_TYPES`) stay in GGUF's blocks, as uint8 rows listed in the file's metadata
(:mod:`triode.engine.model_files.tensor_writer`); every other type is dequantized to
float32 here, and the log says which. The worker decides at load whether a quantized tensor
runs as it is or is dequantized (:func:`triode.engine.worker.placement.kept_quantized`).

It runs in the engine process, while it resolves the model. The tensors take numpy and the
``gguf`` package, and memory of one tensor at a time on top of the mapped file; transformers,
for the metadata, may import torch while it runs.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import logging
import os
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from triode.engine.errors import ModelLoadError, UnsupportedModelError
from triode.engine.model.hf_fields import check_sizes
from triode.engine.model_files.default_model import say
from triode.engine.model_files.gguf_metadata import ROPE_FACTORS, complete_config
from triode.engine.model_files.tensor_writer import PlannedTensor, write_safetensors

# Block types the quantized CPU kernels run (triode.kernels.quant_linear.QUANT_TYPES, which imports
# torch; a test keeps the two equal).
KERNEL_TYPES = frozenset({"Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"})
# GGUF general.architecture -> the transformers class the converted directory names.
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM", "phi3": "Phi3ForCausalLM",
                 "qwen3moe": "Qwen3MoeForCausalLM"}
# transformers' model types where they differ from the GGUF architecture's name
_MODEL_TYPES = {"mistral": "MistralForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
                "qwen3_moe": "Qwen3MoeForCausalLM"}
_GEMMA = ("gemma2", "gemma3")
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "ffn_gate_inp": "mlp.gate",  # a MoE layer's router
}
_GEMMA_LAYER_TENSORS = {**_LAYER_TENSORS, "post_attention_norm": "post_attention_layernorm",
                        "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}
# Phi-3 keeps q/k/v and gate/up fused (the model cuts them at load: models.fused_checkpoint)
_PHI3_LAYER_TENSORS = {**_LAYER_TENSORS, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
# each GGUF architecture's layer tensor names where they differ from llama's
_LAYER_TENSORS_OF = {"phi3": _PHI3_LAYER_TENSORS, **dict.fromkeys(_GEMMA, _GEMMA_LAYER_TENSORS)}
# a MoE layer's experts, stacked [experts, rows, columns] in one tensor each: cut per expert
_EXPERT_TENSORS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}

_MODEL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_NAME = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")

logger = logging.getLogger(__name__)

__all__ = ["ARCHITECTURES", "KERNEL_TYPES", "check_gguf", "convert_gguf"]


def check_gguf(path: Path) -> Any:
    """The file's ``gguf.GGUFReader``; raises ModelLoadError unless it parses as a complete
    GGUF file of an architecture triode runs."""
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
    architecture = _architecture(reader)
    if architecture not in ARCHITECTURES:
        raise UnsupportedModelError(
            f"GGUF architecture {architecture!r} is not supported; triode reads "
            f"{', '.join(ARCHITECTURES)}", path=str(path))
    return reader


def _architecture(reader: Any) -> str | None:
    field = reader.fields.get("general.architecture")
    if field is None:
        return None
    return bytes(field.parts[field.data[0]]).decode("utf-8", "replace")


def convert_gguf(gguf_path: Path, out_dir: Path, scratch: Path, *, progress: bool) -> None:
    """Writes ``gguf_path`` into ``out_dir`` as a Hugging Face directory: config.json,
    generation_config.json, the tokenizer files and model.safetensors (quantized blocks where
    the kernels run them)."""
    reader = check_gguf(gguf_path)
    say(progress, f"converting {gguf_path.name} (one-time) ...")
    started = time.monotonic()
    config = _write_config_and_tokenizer(gguf_path, reader, out_dir, scratch, progress)
    tensors = _plan_tensors(reader, config, gguf_path)
    write_safetensors(out_dir / "model.safetensors", tensors, progress)
    kept = sum(1 for t in tensors if t.kind is not None)
    say(progress, f"converted in {time.monotonic() - started:.1f} s "
                  f"({kept} of {len(tensors)} tensors kept quantized)")


def _write_config_and_tokenizer(gguf_path: Path, reader: Any, out_dir: Path, scratch: Path,
                                progress: bool) -> dict[str, Any]:
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    # A clean directory holding only the GGUF, so that stray config or tokenizer files next to
    # the user's file cannot leak into the conversion.
    staging = scratch / "gguf"
    staging.mkdir()
    link = staging / "model.gguf"
    try:
        os.symlink(gguf_path.resolve(), link)
    except OSError:
        shutil.copyfile(gguf_path, link)
    try:
        with _quiet_unless(progress):
            config = AutoConfig.from_pretrained(staging, gguf_file=link.name, local_files_only=True)
            tokenizer = AutoTokenizer.from_pretrained(staging, gguf_file=link.name, local_files_only=True)
    except Exception as e:
        raise ModelLoadError(f"cannot read the GGUF metadata ({type(e).__name__}: {e})",
                             path=str(gguf_path)) from e
    raw = config.to_dict()
    raw.pop("quantization_config", None)
    # Where transformers read it from: the scratch directory, gone once the entry is sealed.
    raw.pop("_name_or_path", None)
    model_type = raw.get("model_type")
    architecture = _MODEL_TYPES.get(model_type) or ARCHITECTURES.get(model_type)
    if architecture is None:
        raise UnsupportedModelError(f"GGUF model type {model_type!r} is not supported", path=str(gguf_path))
    raw["architectures"] = [architecture]
    complete_config(raw, reader)
    (out_dir / "config.json").write_text(json.dumps(raw, indent=2, sort_keys=True), encoding="utf-8")
    # The EOS and special token ids, as transformers derives them from the model config.
    GenerationConfig.from_model_config(config).save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return raw


def _hf_name(gguf_name: str, architecture: str | None = None) -> str | None:
    match = _LAYER_NAME.match(gguf_name)
    if match:
        layer, local, suffix = match.groups()
        mapped = _LAYER_TENSORS_OF.get(architecture, _LAYER_TENSORS).get(local)
        return None if mapped is None else f"model.layers.{layer}.{mapped}.{suffix}"
    stem, _, suffix = gguf_name.rpartition(".")
    mapped = _MODEL_TENSORS.get(stem)
    return None if mapped is None else f"{mapped}.{suffix}"


def _expected_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    inter, vocab = config["intermediate_size"], config["vocab_size"]
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden),
                                          "model.norm.weight": (hidden,), "lm_head.weight": (vocab, hidden)}
    local = {"input_layernorm.weight": (hidden,), "post_attention_layernorm.weight": (hidden,),
             "self_attn.q_proj.weight": (heads * head_dim, hidden), "self_attn.q_proj.bias": (heads * head_dim,),
             "self_attn.k_proj.weight": (kv_heads * head_dim, hidden), "self_attn.k_proj.bias": (kv_heads * head_dim,),
             "self_attn.v_proj.weight": (kv_heads * head_dim, hidden), "self_attn.v_proj.bias": (kv_heads * head_dim,),
             "self_attn.o_proj.weight": (hidden, heads * head_dim), "self_attn.o_proj.bias": (hidden,),
             "self_attn.q_norm.weight": (head_dim,), "self_attn.k_norm.weight": (head_dim,),
             "mlp.gate_proj.weight": (inter, hidden), "mlp.up_proj.weight": (inter, hidden),
             "mlp.down_proj.weight": (hidden, inter),
             "pre_feedforward_layernorm.weight": (hidden,), "post_feedforward_layernorm.weight": (hidden,),
             "self_attn.qkv_proj.weight": ((heads + 2 * kv_heads) * head_dim, hidden),
             "mlp.gate_up_proj.weight": (2 * inter, hidden)}
    if experts := config.get("num_experts") or config.get("num_local_experts"):
        size = config.get("moe_intermediate_size") or inter  # Mixtral's experts are intermediate_size wide
        local["mlp.gate.weight"] = (experts, hidden)
        for expert in range(experts):
            local.update({f"mlp.experts.{expert}.gate_proj.weight": (size, hidden),
                          f"mlp.experts.{expert}.up_proj.weight": (size, hidden),
                          f"mlp.experts.{expert}.down_proj.weight": (hidden, size)})
    for layer in range(config["num_hidden_layers"]):
        shapes.update({f"model.layers.{layer}.{name}": shape for name, shape in local.items()})
    return shapes


def _views(tensor: Any, architecture: str | None) -> Iterator[tuple[str | None, Any, list[int]]]:
    """(Hugging Face name, data, shape) of a GGUF tensor: one, or one per expert of a stacked
    expert tensor."""
    shape = [int(n) for n in reversed(tensor.shape.tolist())]
    match = _LAYER_NAME.match(tensor.name)
    if match and match.group(2) in _EXPERT_TENSORS and len(shape) == 3:
        layer, local, suffix = match.groups()
        for expert in range(shape[0]):
            name = f"model.layers.{layer}.mlp.experts.{expert}.{_EXPERT_TENSORS[local]}.{suffix}"
            yield name, tensor.data[expert], shape[1:]
        return
    yield _hf_name(tensor.name, architecture), tensor.data, shape


def _rotary_rows(rows: int, heads: int) -> Any:
    """The row order that undoes llama.cpp's q/k permutation (HF row -> GGUF row)."""
    import numpy as np

    half = rows // heads // 2
    return np.arange(rows).reshape(heads, half, 2).transpose(0, 2, 1).reshape(rows)


def _plan_tensors(reader: Any, config: dict[str, Any], gguf_path: Path) -> list[PlannedTensor]:
    import numpy as np
    from gguf.quants import dequantize

    check_sizes(config, str(gguf_path))  # before tables of its counts are built
    expected = _expected_shapes(config)
    heads = config["num_attention_heads"]
    permute = {".q_proj.": heads, ".k_proj.": config.get("num_key_value_heads") or heads}
    architecture = _architecture(reader)
    unpermute = architecture == "llama"
    gemma = architecture in _GEMMA
    planned, dequantized = [], []
    views = ((tensor, *view) for tensor in reader.tensors for view in _views(tensor, architecture)
             if tensor.name != "rope_freqs.weight" and tensor.name not in ROPE_FACTORS)
    # (rope factors, llama3's and Phi-3's, are in the config's rope scaling)
    for tensor, name, data, shape in views:
        if name is None or name not in expected:
            raise ModelLoadError(f"tensor {tensor.name} has no place in a "
                                 f"{config['architectures'][0]} model", path=str(gguf_path))
        if tuple(shape) != expected[name]:
            raise ModelLoadError(f"tensor {tensor.name} has shape {shape}, but the file's header "
                                 f"says {list(expected[name])}", path=str(gguf_path))
        order = None
        if unpermute:
            heads_of = next((n for fragment, n in permute.items() if fragment in name), None)
            order = None if heads_of is None else _rotary_rows(shape[0], heads_of)
        kind = tensor.tensor_type.name
        if kind in KERNEL_TYPES:
            def produce(data=data, order=order):
                return data if order is None else data[order]
            planned.append(PlannedTensor(name, kind, list(data.shape), int(data.nbytes), produce))
            continue
        if kind not in ("F32", "F16", "BF16"):
            if not _dequantizes(tensor.tensor_type):
                raise UnsupportedModelError(f"tensor {tensor.name} is of block type {kind}, which neither "
                                            f"triode's kernels nor the gguf package's dequantization read",
                                            path=str(gguf_path))
            dequantized.append(f"{tensor.name} ({kind})")

        offset = 1.0 if gemma and name.endswith("norm.weight") else 0.0  # llama.cpp stores 1 + w

        def produce(data=data, kind_id=tensor.tensor_type, shape=shape, order=order, offset=offset):
            values = dequantize(data, kind_id).astype(np.float32, copy=False).reshape(shape)
            values = values - offset if offset else values
            return values if order is None else values[order]
        planned.append(PlannedTensor(name, None, shape, 4 * int(np.prod(shape)), produce))
    if dequantized:
        logger.warning("%s: %d tensors are of block types triode's kernels do not run and are "
                       "dequantized to float32: %s", gguf_path.name, len(dequantized),
                       ", ".join(dequantized[:5]) + (" ..." if len(dequantized) > 5 else ""))
    return planned


@functools.cache
def _dequantizes(kind: Any) -> bool:
    """Whether the gguf package dequantizes this block type (I8 and others it does not), asked
    of one zero block."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES
    from gguf.quants import dequantize

    try:
        dequantize(np.zeros((1, GGML_QUANT_SIZES[kind][1]), np.uint8), kind)
    except NotImplementedError:
        return False
    return True


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
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()
