"""`triode bench tp`: tensor parallelism on this machine, TP=1 against TP=N (default 2).

For each size, one engine (``engine.LLM``) on the same model: the peak resident memory of
every rank while it loaded its shard (VmHWM read in the worker once the weights are in,
before the KV cache; the baseline is the worker's own before the load), then W1 offline
throughput (greedy, ignore_eos) with per-step time and per-step collective time (all-reduce
+ logits gather, measured inside the model) of each rank. ``--num-prompts`` /
``--max-tokens`` shrink W1 for a quick check; the published numbers use the full workload.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from triode.bench.report import machine_description, plot_bars, print_table, write_json
from triode.bench.throughput import timed_generate
from triode.bench.workloads import Workload, make_workload
from triode.engine.config import EngineArgs
from triode.engine.llm import LLM
from triode.engine.model_files.resolve import resolve_model

MiB = 1 << 20


def _scaled(workload: Workload, num_prompts: int | None, max_tokens: int | None) -> Workload:
    prompts = workload.prompts[:num_prompts] if num_prompts else workload.prompts
    lens = workload.output_lens[: len(prompts)]
    if max_tokens:
        lens = tuple(min(n, max_tokens) for n in lens)
    return Workload(name=workload.name, prompts=prompts, output_lens=lens)


def _mib(value: int | None) -> float | str:
    return "-" if value is None else value / MiB


def measure(model: str | None, size: int, workload: Workload, kv_cache_memory: str) -> dict:
    started = time.perf_counter()
    with LLM(model, tensor_parallel_size=size, kv_cache_memory=kv_cache_memory, max_model_len=1024) as llm:
        startup = time.perf_counter() - started
        infos = llm.llm_engine.supervisor.worker_infos
        seconds, before, after, _ = timed_generate(llm, workload)
    produced = workload.total_output_tokens
    steps = max(1, after.steps - before.steps)
    step_ms = [
        (a - b) / steps * 1000
        for a, b in zip(after.rank_step_seconds_total, before.rank_step_seconds_total, strict=True)
    ]
    collective_ms = [
        (a - b) / steps * 1000
        for a, b in zip(after.rank_collective_seconds_total, before.rank_collective_seconds_total, strict=True)
    ]
    return {
        "tensor_parallel_size": size,
        "startup_seconds": startup,
        "seconds": seconds,
        "tokens_per_second": produced / seconds,
        "steps": steps,
        "rank_step_ms": step_ms,
        "rank_collective_ms": collective_ms,
        "ranks": [
            {
                "rank": info.rank,
                "kv_heads": info.kv_heads,
                "load_seconds": info.load_seconds,
                "baseline_rss_mib": _mib(info.baseline_rss_bytes),
                "weights_peak_rss_mib": _mib(info.weights_peak_rss_bytes),
                "peak_rss_mib": _mib(info.peak_rss_bytes),
            }
            for info in infos
        ],
    }


def run(
    *,
    model: str | None = None,
    sizes: tuple[int, ...] = (1, 2),
    num_prompts: int | None = None,
    max_tokens: int | None = None,
    kv_cache_memory: str = "2GiB",
    output_dir: Path = Path("bench-results"),
) -> dict:
    print(f"triode bench tp on {machine_description()}")
    args = EngineArgs.from_env(model=model)
    config = json.loads((resolve_model(args.model, cache_dir=args.resolved_cache_dir()).path / "config.json").read_text())
    workload = _scaled(make_workload("W1", vocab_size=config["vocab_size"]), num_prompts, max_tokens)
    print(f"workload W1: {len(workload.prompts)} prompts of 128 tokens, "
          f"{workload.total_output_tokens} output tokens; kv_cache_memory {kv_cache_memory} per rank")
    results = {size: measure(model, size, workload, kv_cache_memory) for size in sizes}

    print("\nthroughput (W1, greedy, float32)")
    rows = []
    for size, entry in results.items():
        rows.append([
            f"TP={size}", entry["tokens_per_second"], entry["steps"],
            " / ".join(f"{ms:.1f}" for ms in entry["rank_step_ms"]),
            " / ".join(f"{ms:.1f}" for ms in entry["rank_collective_ms"]),
            entry["startup_seconds"],
        ])
    print_table(["size", "output tok/s", "steps", "step ms per rank", "all-reduce ms per step",
                 "start-up s"], rows)

    print("\npeak resident memory per rank while loading (VmHWM, MiB)")
    rows = []
    for size, entry in results.items():
        for rank in entry["ranks"]:
            grew = (rank["weights_peak_rss_mib"] - rank["baseline_rss_mib"]
                    if isinstance(rank["weights_peak_rss_mib"], float)
                    and isinstance(rank["baseline_rss_mib"], float) else "-")
            rows.append([f"TP={size}", rank["rank"], rank["kv_heads"], rank["baseline_rss_mib"],
                         rank["weights_peak_rss_mib"], grew, rank["peak_rss_mib"], rank["load_seconds"]])
    print_table(["size", "rank", "KV heads", "before load", "weights loaded", "load added",
                 "with KV cache", "load s"], rows)
    if 1 in results and len(results) > 1:
        base = results[1]["tokens_per_second"]
        for size, entry in results.items():
            if size != 1:
                print(f"TP={size} / TP=1 throughput: {entry['tokens_per_second'] / base:.2f}x")
    write_json(output_dir / "tp.json", {"workload": "W1", "num_prompts": len(workload.prompts),
                                        "results": {str(k): v for k, v in results.items()}})
    plot_step_times(results, output_dir / "tp.png")
    print(f"wrote {output_dir / 'tp.json'} and {output_dir / 'tp.png'}")
    return results


def plot_step_times(results: dict, path: Path) -> None:
    """Each rank's step time and its collective part, one group per (size, rank)."""
    groups, steps, collectives = [], [], []
    for size, entry in results.items():
        for rank, (step_ms, collective_ms) in enumerate(
            zip(entry["rank_step_ms"], entry["rank_collective_ms"], strict=True)
        ):
            groups.append(f"TP={size} rank {rank}\n{entry['tokens_per_second']:.0f} tok/s")
            steps.append(step_ms)
            collectives.append(collective_ms)
    plot_bars(path, title="W1 step time per rank (greedy, float32)", y_label="ms per step",
              groups=groups, series={"step": steps, "of it all-reduce + gather": collectives})
