"""Hugging Face checkpoints of real models' shapes with random weights, written from a config
(no hub): what `triode bench step --shape` times on a machine without the real weights."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import torch

from triode.bench.synthetic_gguf import SHAPES


def write_random_model(directory: Path, shape_name: str, *, dtype: torch.dtype = torch.bfloat16,
                       device: str = "cpu", seed: int = 0) -> Path:
    """Writes a Llama-architecture checkpoint of ``SHAPES[shape_name]`` into ``directory``
    (initialised on ``device``, which is much faster on a GPU for an 8B shape)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = SHAPES[shape_name]
    config = LlamaConfig(
        vocab_size=shape["vocab"], hidden_size=shape["hidden"], intermediate_size=shape["intermediate"],
        num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"], max_position_embeddings=shape["context"],
        rope_theta=shape["rope_theta"], tie_word_embeddings=shape["tied"], torch_dtype=dtype,
        bos_token_id=1, eos_token_id=2,
    )
    started = time.perf_counter()
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype)
    model.save_pretrained(directory)
    del model
    print(f"wrote a random {shape_name} checkpoint ({dtype}) to {directory} in "
          f"{time.perf_counter() - started:.0f} s", flush=True)
    return directory


def copy_tokenizer(source: Path, directory: Path) -> Path:
    """Puts ``source``'s tokenizer files into ``directory`` (a random checkpoint has none; the
    benchmarks that go through ``LLM`` give it the default model's, whose ids it samples from
    or beyond, which decode to nothing)."""
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        if (source / name).exists():
            shutil.copy(source / name, directory / name)
    return directory


def weight_bytes(path: Path) -> int:
    """Bytes of the checkpoint's tensors (what a decode step reads at least once)."""
    return sum(file.stat().st_size for file in path.glob("*.safetensors"))


def copy_bandwidth(device: torch.device, size_bytes: int = 1 << 30, repeats: int = 5) -> float:
    """Bytes per second of a device-to-device copy (read + write counted as 2 x size)."""
    source = torch.empty(size_bytes, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        target.copy_(source)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - started)
    return 2 * size_bytes / best
