"""``triode bench write-gguf``: a GGUF file of a real model's shape with random weights, for
benchmarks of models that cannot be downloaded here (no model hub).

The tensors are random blocks of the file type's quantizations, with scales chosen so that
weights stay around +-0.02 and centred on zero; the tokenizer is the default model's
(SmolLM2's byte-level BPE), its vocabulary padded with reserved tokens up to the shape's.
``Q4_K_M`` follows llama.cpp's recipe: Q4_K everywhere except the value projections and
down projections of the first and last eighth of the layers and of every third layer
between (Q6_K), and the output layer (Q6_K); a matrix whose rows are not whole 256-weight
blocks takes Q8_0 instead. The file is written a tensor at a time.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from triode.bench.commands import usage_error

SHAPES: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": dict(hidden=4096, intermediate=14336, layers=32, heads=32, kv_heads=8, vocab=128256,
                         context=8192, rope_theta=500000.0, tied=False),
    "smollm2-135m": dict(hidden=576, intermediate=1536, layers=30, heads=9, kv_heads=3, vocab=49152,
                         context=8192, rope_theta=100000.0, tied=True),
    "smollm2-360m": dict(hidden=960, intermediate=2560, layers=32, heads=15, kv_heads=5, vocab=49152,
                         context=8192, rope_theta=100000.0, tied=True),
}
FILE_TYPES = ("Q4_K_M", "Q4_0", "Q8_0")
_BLOCKS = {"Q4_K": (256, 144), "Q6_K": (256, 210), "Q4_0": (32, 18), "Q8_0": (32, 34)}
_PROGRESS_EVERY_S = 5.0


def add_bpe_tokenizer(writer: Any, tokenizer: Any, *, vocab_size: int | None = None) -> None:
    """Writes a byte-level BPE tokenizer (transformers' fast tokenizer) as GGUF metadata,
    padded with ``<|reserved_N|>`` tokens to ``vocab_size``."""
    vocab = [token for token, _ in sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])]
    special = set(tokenizer.all_special_tokens) | {"<|im_start|>", "<|im_end|>"}
    types = [3 if token in special else 1 for token in vocab]
    padding = max((vocab_size or 0) - len(vocab), 0)
    vocab += [f"<|reserved_{i}|>" for i in range(padding)]
    types += [4] * padding  # user-defined: never produced by a merge
    merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(vocab)
    writer.add_token_types(types)
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    writer.add_eos_token_id(tokenizer.eos_token_id)
    if tokenizer.chat_template:
        writer.add_chat_template(tokenizer.chat_template)


def tensor_kinds(shape: dict[str, Any], file_type: str) -> dict[str, str]:
    """GGUF tensor name -> block type for every matrix of ``shape`` in ``file_type``."""
    layers = shape["layers"]
    kinds = {"token_embd.weight": "Q4_K" if file_type == "Q4_K_M" else file_type}
    if not shape["tied"]:
        kinds["output.weight"] = "Q6_K" if file_type == "Q4_K_M" else file_type
    for layer in range(layers):
        more_bits = layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2
        for local in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"):
            kind = file_type
            if file_type == "Q4_K_M":
                kind = "Q6_K" if local in ("attn_v", "ffn_down") and more_bits else "Q4_K"
            kinds[f"blk.{layer}.{local}.weight"] = kind
    return kinds


def random_blocks(kind: str, rows: int, columns: int, rng: Any) -> Any:
    """uint8 [rows, bytes]: random blocks of ``kind`` whose weights lie within about +-0.02."""
    import numpy as np

    weights, nbytes = _BLOCKS[kind]
    count = rows * columns // weights
    blocks = np.frombuffer(rng.bytes(count * nbytes), dtype=np.uint8).reshape(count, nbytes).copy()

    def halves(value: float) -> Any:
        return np.full((count, 1), value, dtype=np.float16).view(np.uint8)

    if kind == "Q4_K":
        # 6-bit sub-block scales 1..8 and minimums 7.5x them: w = d*sc*q - d*m, q in 0..15.
        sc = rng.integers(1, 9, size=(count, 8), dtype=np.uint8)
        m = np.rint(7.5 * sc).astype(np.uint8)
        scales = np.concatenate([sc[:, :4] | ((sc[:, 4:] >> 4) << 6), m[:, :4] | ((m[:, 4:] >> 4) << 6),
                                 (sc[:, 4:] & 0xF) | ((m[:, 4:] & 0xF) << 4)], axis=1)
        d = 0.02 / 60
        blocks[:, 0:4] = np.concatenate([halves(d), halves(d)], axis=1)
        blocks[:, 4:16] = scales
    elif kind == "Q6_K":
        # w = d * scale * (q - 32), q in 0..63, int8 scales 1..16.
        blocks[:, 192:208] = rng.integers(1, 17, size=(count, 16), dtype=np.uint8)
        blocks[:, 208:210] = halves(0.02 / (16 * 32))
    elif kind == "Q4_0":
        blocks[:, 0:2] = halves(0.02 / 8)  # w = d * (q - 8)
    elif kind == "Q8_0":
        blocks[:, 0:2] = halves(0.02 / 128)  # w = d * q, q int8
    return blocks.reshape(rows, -1)


def write_synthetic_gguf(path: Path, shape_name: str, file_type: str, *, seed: int = 0,
                         progress: bool = True) -> int:
    """Writes the file; returns its size in bytes. The file appears whole or not at all: it is
    written beside ``path`` under a hidden name and renamed into place, so that a Ctrl-C or a
    full disk leaves no truncated model for a later run to load."""
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    try:
        size = _write(partial, shape_name, file_type, seed=seed, progress=progress)
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    return size


def _write(path: Path, shape_name: str, file_type: str, *, seed: int, progress: bool) -> int:
    import gguf
    import numpy as np

    from triode.engine.inputs import load_tokenizer
    from triode.engine.model_files.resolve import resolve_model

    shape = SHAPES[shape_name]
    rng = np.random.default_rng(seed)
    hidden, heads, kv_heads = shape["hidden"], shape["heads"], shape["kv_heads"]
    head_dim = hidden // heads
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name(f"random {shape_name} {file_type}")
    writer.add_context_length(shape["context"])
    writer.add_embedding_length(hidden)
    writer.add_block_count(shape["layers"])
    writer.add_feed_forward_length(shape["intermediate"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(shape["rope_theta"])
    writer.add_rope_dimension_count(head_dim)
    tokenizer = load_tokenizer(resolve_model(None, cache_dir=_cache_dir(), progress=progress).path)
    add_bpe_tokenizer(writer, tokenizer, vocab_size=shape["vocab"])
    matrices = {"token_embd.weight": (shape["vocab"], hidden), "output.weight": (shape["vocab"], hidden)}
    local = {"attn_q": (heads * head_dim, hidden), "attn_k": (kv_heads * head_dim, hidden),
             "attn_v": (kv_heads * head_dim, hidden), "attn_output": (hidden, heads * head_dim),
             "ffn_gate": (shape["intermediate"], hidden), "ffn_up": (shape["intermediate"], hidden),
             "ffn_down": (hidden, shape["intermediate"])}
    for layer in range(shape["layers"]):
        matrices.update({f"blk.{layer}.{name}.weight": dims for name, dims in local.items()})
    kinds = tensor_kinds(shape, file_type)
    plan: list[tuple[str, tuple[int, ...], str | None]] = [("output_norm.weight", (hidden,), None)]
    for name, kind in kinds.items():
        if matrices[name][1] % _BLOCKS[kind][0]:
            kind = "Q8_0"  # rows that are not whole blocks (llama.cpp falls back to Q5_0 or Q8_0)
        plan.append((name, matrices[name], kind))
        if name.endswith("attn_output.weight"):
            block = name.split(".")[1]
            plan += [(f"blk.{block}.attn_norm.weight", (hidden,), None),
                     (f"blk.{block}.ffn_norm.weight", (hidden,), None)]
    total = 0
    for name, dims, kind in plan:
        nbytes = 4 * dims[0] if kind is None else dims[0] * (dims[1] // _BLOCKS[kind][0] * _BLOCKS[kind][1])
        total += nbytes
        if kind is None:
            writer.add_tensor_info(name, dims, np.dtype(np.float32), nbytes)
        else:
            writer.add_tensor_info(name, (dims[0], nbytes // dims[0]), np.dtype(np.uint8), nbytes,
                                   raw_dtype=gguf.GGMLQuantizationType[kind])
    try:  # the writer opens the file here
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        written, reported = 0, time.monotonic()
        for _, dims, kind in plan:
            data = np.ones(dims, dtype=np.float32) if kind is None else random_blocks(kind, *dims, rng)
            writer.write_tensor_data(data)
            written += data.nbytes
            if progress and time.monotonic() - reported >= _PROGRESS_EVERY_S:
                reported = time.monotonic()
                print(f"  {written / total:.0%} of {total / 1e9:.2f} GB written", flush=True)
    finally:
        writer.close()
    return path.stat().st_size


def _cache_dir() -> str:
    from triode.engine.config import EngineArgs

    return EngineArgs.from_env().resolved_cache_dir()


def command(namespace: Any) -> int:
    path = Path(namespace.path)
    if path.suffix.lower() != ".gguf":
        usage_error(f"write-gguf writes a .gguf file; got {str(path)!r}")
    path.parent.mkdir(parents=True, exist_ok=True)  # /tmp/syn/... as the docs write it
    started = time.monotonic()
    size = write_synthetic_gguf(path, namespace.shape, namespace.file_type, seed=namespace.seed)
    print(f"wrote {path}: random {namespace.shape} weights in {namespace.file_type}, {size / 1e9:.2f} GB "
          f"in {time.monotonic() - started:.0f} s")
    return 0
