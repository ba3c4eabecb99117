"""`triode bench throughput --compare-async-scheduling` / `--compare-batch-invariant`: W1 and
W1v through ``LLM.generate`` with one engine setting off and on, two engines side by side,
alternated round by round so that a machine's drift hits both alike."""

from __future__ import annotations

from pathlib import Path

from triode.bench.report import machine_description, plot_bars, print_table, write_json
from triode.bench.throughput import run_triode
from triode.bench.workloads import make_workload
from triode.engine.llm import LLM

# EngineArgs field -> what the report calls it
SETTINGS = {"async_scheduling": "async scheduling", "batch_invariant": "--batch-invariant"}
MODES = {"off": False, "on": True}


def run(*, setting: str, model: str | None, workloads: tuple[str, ...] = ("W1", "W1v"), rounds: int = 2,
        dtype: str = "float32", output_dir: Path = Path("bench-results")) -> dict:
    if setting not in SETTINGS:
        raise ValueError(f"setting: one of {', '.join(SETTINGS)}; got {setting!r}")
    flag, name_of = f"--compare-{setting.replace('_', '-')}", SETTINGS[setting]
    print(f"triode bench throughput {flag} ({dtype}, {rounds} rounds) on {machine_description()}")
    runs: dict[str, dict[str, list[dict]]] = {name: {mode: [] for mode in MODES} for name in workloads}
    engines = {mode: LLM(model, kv_cache_memory="4GiB", max_model_len=1024, dtype=dtype, **{setting: on})
               for mode, on in MODES.items()}
    try:
        for _ in range(rounds):
            for name in workloads:
                workload = make_workload(name, vocab_size=engines["off"].llm_engine.vocab_size)
                for mode, llm in engines.items():
                    runs[name][mode].append(run_triode(llm, workload))
    finally:
        for llm in engines.values():
            llm.close()
    best = {name: {mode: max(r["tokens_per_second"] for r in results) for mode, results in by_mode.items()}
            for name, by_mode in runs.items()}
    print_table(
        ["workload", *(f"round {i + 1} off / on tok/s" for i in range(rounds)), "best off", "best on", "on/off"],
        [[name, *(f"{runs[name]['off'][i]['tokens_per_second']:.1f} / {runs[name]['on'][i]['tokens_per_second']:.1f}"
                  for i in range(rounds)),
          best[name]["off"], best[name]["on"], f"{best[name]['on'] / best[name]['off']:.2f}x"]
         for name in workloads],
    )
    results = {"setting": setting, "dtype": dtype, "rounds": rounds, "runs": runs, "best": best}
    stem = f"throughput-{setting.replace('_', '-')}"
    write_json(output_dir / f"{stem}.json", results)
    plot_bars(output_dir / f"{stem}.png",
              title=f"LLM.generate output tokens/s, {name_of} off vs on ({dtype}, best of {rounds})",
              y_label="output tokens / s", groups=list(workloads),
              series={f"{name_of} {mode}": [best[name][mode] for name in workloads] for mode in MODES})
    print(f"wrote {output_dir / f'{stem}.json'} and {output_dir / f'{stem}.png'}")
    return results
