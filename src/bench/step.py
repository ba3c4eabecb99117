"""`triode bench step`: decode step time of our runner against Hugging Face's model forward
with its KV cache, at the same batch size and context, measured in the same run; with
``--dtypes auto float32``, a quantized model's runner from its blocks and dequantized, side by
side. ``--shape`` times a random-weight checkpoint of a real model's shape instead of
``--model``; ``--compare-eager`` adds the same runner with ``enforce_eager`` (on a GPU: without
CUDA graphs) and the step's weight-read limit (weight bytes over the copy bandwidth measured in
the same run)."""

from __future__ import annotations

import contextlib
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import attrs
import torch
from tqdm import tqdm

from triode import kernels
from triode.bench.random_models import copy_bandwidth, weight_bytes, write_random_model
from triode.bench.report import (
    load_hf_reference,
    machine_description,
    plot_lines,
    print_table,
    write_json,
)
from triode.engine.config import EngineArgs
from triode.engine.lora.request import LoRARequest
from triode.engine.model.config import ModelConfig
from triode.engine.model_files.layout import load_hf_config
from triode.engine.model_files.resolve import resolve_model
from triode.engine.sampling_params import SamplingParams
from triode.engine.worker.runner import ModelRunner
from triode.engine.worker_messages import NewSequence, ScheduledChunk, StepPlan
from triode.kernels.quant_linear import QuantizedWeight


def random_prompts(batch: int, length: int, vocab: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab - 100, (batch, length), generator=generator)


def time_ours(runner: ModelRunner, prompts: torch.Tensor, steps: int,
              loras: Sequence[LoRARequest | None] = ()) -> float:
    """Median seconds of one decode step for the whole batch, after a prefill of ``prompts``;
    ``loras``: each sequence's adapter (none by default)."""
    batch, length = prompts.shape
    params = SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True)
    blocks_per_seq = -(-(length + steps + 1) // runner.block_size)
    if batch * blocks_per_seq > runner.num_blocks:  # the blocks below are handed out unchecked
        raise ValueError(f"{batch} sequences of {length + steps + 1} tokens need {batch * blocks_per_seq} KV "
                         f"blocks; the runner has {runner.num_blocks}")
    new, chunks = [], []
    for i in range(batch):
        seq_id = f"bench-{batch}-{i}"
        ids = tuple(prompts[i].tolist())
        new.append(NewSequence(seq_id=seq_id, prompt_token_ids=ids, params=params, lora=loras[i] if loras else None))
        blocks = tuple(range(i * blocks_per_seq, (i + 1) * blocks_per_seq))
        chunks.append(ScheduledChunk(seq_id=seq_id, token_ids=ids, start_position=0, new_block_ids=blocks))
    result = runner.execute(StepPlan(step_id=0, new_sequences=tuple(new), chunks=tuple(chunks)))
    last = dict(zip(result.sampled.seq_ids, result.sampled.token_ids, strict=True))
    times = []
    for step in range(steps):
        plan = StepPlan(step_id=step + 1, chunks=tuple(
            ScheduledChunk(seq_id=seq_id, token_ids=(token,), start_position=length + step)
            for seq_id, token in last.items()
        ))
        started = time.perf_counter()
        result = runner.execute(plan)
        times.append(time.perf_counter() - started)
        last = dict(zip(result.sampled.seq_ids, result.sampled.token_ids, strict=True))
    runner.execute(StepPlan(step_id=steps + 1, finished_seq_ids=tuple(last)))
    return statistics.median(times)


def time_hf(model, prompts: torch.Tensor, steps: int) -> float:
    """The same for HF's forward with its cache. The sampled ids come back to the host each
    step, as ours do, so that on a GPU both figures include the step's synchronisation."""
    from transformers import DynamicCache

    cache = DynamicCache()
    prompts = prompts.to(model.device)
    with torch.inference_mode():
        out = model(prompts, cache=cache, use_cache=True, logits_to_keep=1)
        next_ids = out.logits[:, -1].argmax(-1, keepdim=True)
        times = []
        for _ in range(steps):
            started = time.perf_counter()
            out = model(next_ids, cache=cache, use_cache=True, logits_to_keep=1)
            next_ids = out.logits[:, -1].argmax(-1, keepdim=True)
            next_ids.tolist()
            times.append(time.perf_counter() - started)
    return statistics.median(times)


def kv_budget(path: Path, batch: int, tokens: int, block_size: int) -> int:
    """Bytes of KV cache that hold ``batch`` sequences of ``tokens`` in float32 (the widest
    dtype a runner here may use), and at least 2 GiB."""
    config = ModelConfig.from_hf(load_hf_config(path))
    blocks = batch * -(-tokens // block_size)
    per_block = block_size * 2 * config.num_layers * config.num_kv_heads * config.head_dim * 4
    return max(2 << 30, blocks * per_block)


def _label(runner: ModelRunner, activation: str) -> str:
    """What a runner computes with: its dtype, and the block types it keeps quantized."""
    kinds = sorted(set(runner.quantized.values()))
    dtype = str(runner.dtype).removeprefix("torch.")
    if not kinds:
        return dtype
    interleaved = any(isinstance(p, QuantizedWeight) and p.interleaved for m in runner.model.modules()
                      for p in getattr(m, "parts", None) or ())
    return f"{'+'.join(kinds)} weights{' interleaved' if interleaved else ''}, {activation} activations"


def run(
    *,
    model: str | None,
    batch_sizes: tuple[int, ...] = (1, 8, 32, 64),
    context: int = 128,
    steps: int = 8,
    dtypes: tuple[str, ...] = ("auto",),
    activations: tuple[str, ...] = ("float32",),
    shape: str | None = None,
    compare_eager: bool = False,
    compare_batch_invariant: bool = False,
    output_dir: Path = Path("bench-results"),
) -> list[dict]:
    with contextlib.ExitStack() as stack:
        if shape is not None:
            scratch = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="triode-bench-step-")))
            device = "cuda" if torch.cuda.is_available() else "cpu"
            model = str(write_random_model(scratch / shape, shape, device=device))
        return _run(model=model, batch_sizes=batch_sizes, context=context, steps=steps, dtypes=dtypes,
                    activations=activations, compare_eager=compare_eager,
                    compare_batch_invariant=compare_batch_invariant, output_dir=output_dir)


def _run(*, model, batch_sizes, context, steps, dtypes, activations, compare_eager, compare_batch_invariant,
         output_dir) -> list[dict]:
    args = EngineArgs.from_env(model=model, max_num_seqs=max(256, *batch_sizes))
    resolved = resolve_model(args.model, cache_dir=args.resolved_cache_dir())
    args = attrs.evolve(args, kv_cache_memory=kv_budget(resolved.path, max(batch_sizes), context + steps + 1,
                                                         args.block_size))
    # One runner per dtype; one that keeps quantized weights, one per activation type (loaded
    # with it: integer activations may interleave the weights). The activation type is a
    # process-wide kernel setting, set again before each runner is timed.
    runners: dict[str, ModelRunner] = {}
    settings: dict[str, str] = {}
    for dtype in dtypes:
        for activation in activations:
            runner = ModelRunner(attrs.evolve(args, dtype=dtype, quantized_activations=activation), resolved.path)
            if not runner.quantized:
                runners[dtype], settings[dtype] = runner, kernels.quantized_activations()
                break
            key = dtype if len(activations) == 1 else f"{dtype}_{activation}"
            runners[key], settings[key] = runner, kernels.quantized_activations()
    first = next(iter(runners.values()))
    if compare_eager:
        runners["eager"] = ModelRunner(attrs.evolve(args, dtype=dtypes[0], enforce_eager=True,
                                                    quantized_activations=activations[0]), resolved.path)
        settings["eager"] = kernels.quantized_activations()
    if compare_batch_invariant:  # a process-wide kernel setting too, set before each runner is timed
        runners["invariant"] = ModelRunner(attrs.evolve(args, dtype=dtypes[0], batch_invariant=True,
                                                        quantized_activations=activations[0]), resolved.path)
        settings["invariant"] = kernels.quantized_activations()
    hf_model = load_hf_reference(resolved.path, first.dtype, first.device)
    vocab = first.config.vocab_size
    labels = {key: _label(runner, settings[key]) for key, runner in runners.items()}
    for key, runner in runners.items():
        labels[key] += ", --enforce-eager" if key == "eager" else ", eager" if runner.graphs is None else ", CUDA graphs"
        labels[key] += ", --batch-invariant" if key == "invariant" else ""
    read_limit_ms = None
    if compare_eager:
        read_limit_ms = weight_bytes(resolved.path) / copy_bandwidth(first.device) * 1e3
        print(f"weight-read limit: {weight_bytes(resolved.path) / 1e9:.2f} GB of weights at the copy "
              f"bandwidth measured now: {read_limit_ms:.2f} ms per step")
    print(f"triode bench step: {resolved.source}, context {context} tokens, {steps} decode steps, "
          f"triode {' / '.join(labels.values())}, HF {first.dtype} on {first.device}; {machine_description()}")
    rows = []
    for batch in tqdm(batch_sizes, desc="batch sizes", unit="batch"):
        prompts = random_prompts(batch, context, vocab, seed=batch)
        row = {"batch": batch}
        for key, runner in runners.items():
            kernels.set_quantized_activations(settings[key])
            kernels.set_batch_invariant(key == "invariant")
            row[f"triode_{key}_ms"] = time_ours(runner, prompts, steps) * 1e3
        row["hf_ms"] = time_hf(hf_model, prompts, steps) * 1e3
        if read_limit_ms is not None:
            row["read_limit_ms"] = read_limit_ms
        rows.append(row)
    limit = ["weight-read limit ms"] if read_limit_ms is not None else []
    print_table(
        ["batch", *(f"triode {label} ms" for label in labels.values()), "HF ms/step",
         *(f"HF/{label}" for label in labels.values()), *limit],
        [[r["batch"], *(r[f"triode_{d}_ms"] for d in runners), r["hf_ms"],
          *(f"{r['hf_ms'] / r[f'triode_{d}_ms']:.2f}x" for d in runners),
          *([r["read_limit_ms"]] if limit else [])] for r in rows],
    )
    write_json(output_dir / "step.json", {"context": context, "steps": steps, "triode": labels, "rows": rows})
    plot_lines(
        output_dir / "step.png", title=f"Decode step time, context {context}",
        x_label="batch size", y_label="ms per step", x=[r["batch"] for r in rows],
        series={**{f"triode {labels[d]}": [r[f"triode_{d}_ms"] for r in rows] for d in runners},
                "HF transformers": [r["hf_ms"] for r in rows],
                **({"weight-read limit": [r["read_limit_ms"] for r in rows]} if limit else {})},
        log_x=True,
    )
    print(f"wrote {output_dir / 'step.json'} and {output_dir / 'step.png'}")
    return rows
