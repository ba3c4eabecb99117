"""`triode bench step --lora`: what LoRA adapters cost a decode step. One runner with
``--enable-lora`` times, at each batch size and in the same run, the base model's step (no
adapter), every sequence with one adapter, and the batch split among several adapters (each
the median of ``repeats`` runs of ``steps`` steps, the three interleaved); the adapters are
random PEFT files of ``--lora-rank`` on every target module (q, k, v, o, gate,
up, down), written for the model's shape."""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
from pathlib import Path

import attrs
import torch
from safetensors.torch import save_file
from tqdm import tqdm

from triode.bench.report import machine_description, plot_lines, print_table, write_json
from triode.bench.step import kv_budget, random_prompts, time_ours
from triode.engine.config import EngineArgs
from triode.engine.lora.peft_files import TARGET_MODULES, module_shape
from triode.engine.lora.request import LoRARequest
from triode.engine.model.config import ModelConfig
from triode.engine.model_files.layout import load_hf_config
from triode.engine.model_files.resolve import resolve_model
from triode.engine.worker.runner import ModelRunner


def write_random_adapter(directory: str | Path, model: ModelConfig | str | Path, *, rank: int, seed: int,
                         scale: float = 0.01) -> Path:
    """A PEFT adapter of ``model``'s shape (its config, or a model directory): every decoder
    layer's target modules, random A and B (``scale`` times a standard normal: small enough by
    default to leave the model's activations in range)."""
    directory = Path(directory)
    config = model if isinstance(model, ModelConfig) else ModelConfig.from_hf(load_hf_config(Path(model)))
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_layers):
        for module in TARGET_MODULES:
            in_features, out_features = module_shape(config, module)
            block = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{block}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, in_features, generator=generator) / in_features**0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_features, rank, generator=generator) * scale
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    (directory / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGET_MODULES),
        "bias": "none"}))
    return directory


def run(*, model: str | None, batch_sizes: tuple[int, ...] = (1, 64), context: int = 128, steps: int = 32,
        rank: int = 16, adapters: int = 3, repeats: int = 3, dtype: str = "auto",
        output_dir: Path = Path("bench-results")) -> list[dict]:
    args = EngineArgs.from_env(model=model, max_num_seqs=max(256, *batch_sizes), enable_lora=True,
                               max_loras=adapters, max_lora_rank=rank, dtype=dtype)
    resolved = resolve_model(args.model, cache_dir=args.resolved_cache_dir())
    args = attrs.evolve(args, kv_cache_memory=kv_budget(resolved.path, max(batch_sizes), context + steps + 1,
                                                         args.block_size))
    runner = ModelRunner(args, resolved.path)
    with tempfile.TemporaryDirectory(prefix="triode-bench-lora-") as scratch:
        loras = [LoRARequest(f"random-{i}", i + 1,
                             str(write_random_adapter(Path(scratch) / f"a{i}", runner.config, rank=rank, seed=i)))
                 for i in range(adapters)]
        print(f"triode bench step --lora: {resolved.source} ({runner.dtype}, "
              f"{'quantized' if runner.quantized else 'float'} weights), context {context}, {steps} decode "
              f"steps, rank {rank} on q/k/v/o/gate/up/down, 1 and {adapters} adapters; {machine_description()}")
        rows = []
        for batch in tqdm(batch_sizes, desc="batch sizes", unit="batch"):
            prompts = random_prompts(batch, context, runner.config.vocab_size, seed=batch)
            cases = {"base_ms": [], "one_ms": [loras[0]] * batch}
            if batch >= adapters:  # the batch split among the adapters
                cases["mixed_ms"] = [loras[i % adapters] for i in range(batch)]
            times: dict[str, list[float]] = {key: [] for key in cases}
            for _ in range(repeats):  # interleaved, so that a slow spell of the machine hits all three
                for key, row_loras in cases.items():
                    times[key].append(time_ours(runner, prompts, steps, row_loras) * 1e3)
            rows.append({"batch": batch, **{key: statistics.median(values) for key, values in times.items()}})
    def cost(row: dict, key: str) -> str:
        return f"{row[key] / row['base_ms'] - 1:+.1%}" if key in row else "-"

    print_table(["batch", "base ms/step", "1 adapter ms", "cost", f"{adapters} adapters ms", "cost"],
                [[r["batch"], r["base_ms"], r["one_ms"], cost(r, "one_ms"), r.get("mixed_ms"), cost(r, "mixed_ms")]
                 for r in rows])
    write_json(output_dir / "step-lora.json", {"context": context, "steps": steps, "rank": rank,
                                               "adapters": adapters, "model": str(resolved.source), "rows": rows})
    plot_lines(output_dir / "step-lora.png", title=f"Decode step with LoRA adapters (rank {rank}), context {context}",
               x_label="batch size", y_label="ms per step", x=[r["batch"] for r in rows],
               series={"base model": [r["base_ms"] for r in rows],
                       "every sequence one adapter": [r["one_ms"] for r in rows],
                       f"{adapters} adapters mixed": [r.get("mixed_ms", math.nan) for r in rows]},
               log_x=True)
    print(f"wrote {output_dir / 'step-lora.json'} and {output_dir / 'step-lora.png'}")
    return rows


def write_random_adapters(directory: Path, *, model: str | None, count: int, rank: int, scale: float) -> list[Path]:
    """``count`` random adapters of ``model``'s shape (None: the default model) in
    ``directory``/adapter-0, adapter-1, ..."""
    args = EngineArgs(model=model)
    path = resolve_model(args.model, cache_dir=args.resolved_cache_dir()).path
    return [write_random_adapter(directory / f"adapter-{i}", path, rank=rank, seed=i, scale=scale)
            for i in range(count)]


def main(argv: list[str] | None = None) -> int:
    """``python -m triode.bench.lora DIRECTORY``: random adapters for a model (the scenario
    runner writes its adapters so, in a process of its own)."""
    parser = argparse.ArgumentParser(prog="python -m triode.bench.lora",
                                     description="write random PEFT LoRA adapters of a model's shape")
    parser.add_argument("directory", type=Path)
    parser.add_argument("--model", default=None, help="the model (default: the default model)")
    parser.add_argument("--count", type=int, default=1)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--scale", type=float, default=0.01, help="B's values: this times a standard normal")
    namespace = parser.parse_args(argv)
    for path in write_random_adapters(namespace.directory, model=namespace.model, count=namespace.count,
                                      rank=namespace.rank, scale=namespace.scale):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
