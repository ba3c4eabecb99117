"""`triode bench moe`: the decode step of a small mixture-of-experts model next to a dense model
with as many active parameters, in the same run, with random weights (no hub needed).

Both are Qwen3-shaped (q/k norms, GQA) and share every shape but the MLP: the MoE model's
layers hold ``experts`` experts of ``expert_size`` intermediate features and route each token
to ``top_k`` of them; the dense model's MLP has ``top_k * expert_size`` features, the same
weights read and the same multiply-adds per token. What the MoE step costs beyond the dense
one is the routing, the grouping of tokens by expert and, at a batch, the weights of every
expert some token picked. The tokenizer is the default model's.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import attrs
import torch
from tqdm import tqdm

from triode.bench.report import machine_description, plot_lines, print_table, write_json
from triode.bench.step import random_prompts, time_ours
from triode.engine.config import EngineArgs
from triode.engine.model_files.resolve import resolve_model
from triode.engine.worker.runner import ModelRunner


@attrs.frozen(kw_only=True)
class MoEShape:
    hidden: int = 512
    layers: int = 8
    heads: int = 8
    kv_heads: int = 2
    experts: int = 8
    top_k: int = 2
    expert_size: int = 512
    vocab: int = 49152


def _write(directory: Path, shape: MoEShape, *, moe: bool, tokenizer_dir: Path) -> Path:
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    common = dict(vocab_size=shape.vocab, hidden_size=shape.hidden, num_hidden_layers=shape.layers,
                  num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
                  head_dim=shape.hidden // shape.heads, max_position_embeddings=4096, tie_word_embeddings=True)
    if moe:
        config = Qwen3MoeConfig(**common, num_experts=shape.experts, num_experts_per_tok=shape.top_k,
                                moe_intermediate_size=shape.expert_size, intermediate_size=shape.expert_size,
                                norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
        model = Qwen3MoeForCausalLM(config)
    else:
        model = Qwen3ForCausalLM(Qwen3Config(**common, intermediate_size=shape.top_k * shape.expert_size))
    model.save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, directory / name)
    return directory


def _parameters(runner: ModelRunner) -> tuple[int, int]:
    """(all parameters, those one token uses) of the runner's model."""
    config = runner.config
    total = sum(p.numel() for p in runner.model.parameters())
    if not config.num_experts:
        return total, total
    per_expert = 3 * config.hidden_size * config.moe_intermediate_size * config.num_layers
    return total, total - (config.num_experts - config.num_experts_per_tok) * per_expert


def run(*, batch_sizes: tuple[int, ...] = (1, 8, 32, 64), context: int = 128, steps: int = 8,
        shape: MoEShape = MoEShape(), output_dir: Path = Path("bench-results")) -> list[dict]:
    args = EngineArgs.from_env(model=None, kv_cache_memory="1GiB")
    tokenizer_dir = resolve_model(None, cache_dir=args.resolved_cache_dir()).path
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory(prefix="triode-bench-moe-") as scratch:
        runners = {}
        for kind in ("moe", "dense"):
            path = _write(Path(scratch) / kind, shape, moe=kind == "moe", tokenizer_dir=tokenizer_dir)
            runners[kind] = ModelRunner(attrs.evolve(args, model=str(path)), path)
        sizes = {kind: _parameters(runner) for kind, runner in runners.items()}
        print(f"triode bench moe: {shape.experts} experts, top {shape.top_k}, {shape.expert_size} features each, "
              f"against a dense MLP of {shape.top_k * shape.expert_size}; parameters (all / active per token) "
              f"MoE {sizes['moe'][0] / 1e6:.1f}M / {sizes['moe'][1] / 1e6:.1f}M, dense "
              f"{sizes['dense'][0] / 1e6:.1f}M / {sizes['dense'][1] / 1e6:.1f}M; context {context}, "
              f"{steps} decode steps, {runners['moe'].dtype}; {machine_description()}")
        rows = []
        for batch in tqdm(batch_sizes, desc="batch sizes", unit="batch"):
            prompts = random_prompts(batch, context, shape.vocab, seed=batch)
            row = {"batch": batch}
            for kind, runner in runners.items():
                row[f"{kind}_ms"] = time_ours(runner, prompts, steps) * 1e3
            rows.append(row)
        for runner in runners.values():
            runner.close()
    print_table(["batch", "MoE ms/step", "dense ms/step", "MoE/dense"],
                [[r["batch"], r["moe_ms"], r["dense_ms"], f"{r['moe_ms'] / r['dense_ms']:.2f}x"] for r in rows])
    write_json(output_dir / "moe.json", {"shape": attrs.asdict(shape), "context": context, "steps": steps,
                                         "parameters": sizes, "rows": rows})
    plot_lines(output_dir / "moe.png", title=f"Decode step: MoE vs dense of equal active parameters, context {context}",
               x_label="batch size", y_label="ms per step", x=[r["batch"] for r in rows],
               series={"MoE": [r["moe_ms"] for r in rows], "dense": [r["dense_ms"] for r in rows]}, log_x=True)
    print(f"wrote {output_dir / 'moe.json'} and {output_dir / 'moe.png'}")
    return rows
