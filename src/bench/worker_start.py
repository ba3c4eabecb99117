"""`triode bench start`: how long an engine takes to start, and to recover from a worker's
SIGKILL, with workers forked from the forkserver (the default) and spawned from a fresh
interpreter (``TRIODE_WORKER_MULTIPROC_METHOD=spawn``), alternated round by round.

Each round of each method runs in a Python process of its own (so that the forkserver, or
its absence, is that process's), which measures three things on the model:

- first start: ``LLM(model)`` until it is ready, the first engine of the process (with the
  forkserver, this starts it too);
- next start: a second ``LLM(model)`` once the first has closed;
- recovery: a one-token request right after the worker is SIGKILLed (the supervisor sees
  the death, starts a worker, which loads the model, and the request runs), less the same
  request without a kill.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tqdm import tqdm

from triode.bench.report import machine_description, plot_bars, print_table, write_json
from triode.engine.actors.worker_spawn import MULTIPROC_METHODS

PARTS = ("first_start_s", "next_start_s", "recovery_s")
_RESULT_PREFIX = "triode-bench-start: "


def measure_here(model: str | None) -> dict[str, float]:
    """The three figures, measured in this process with its worker start method."""
    from triode.engine.llm import LLM
    from triode.engine.sampling_params import SamplingParams

    one_token = SamplingParams(temperature=0.0, max_tokens=1)
    started = time.perf_counter()
    with LLM(model):
        first = time.perf_counter() - started
    started = time.perf_counter()
    with LLM(model) as llm:
        second = time.perf_counter() - started
        llm.generate("Paris is", one_token, use_tqdm=False)
        began = time.perf_counter()
        llm.generate("Paris is", one_token, use_tqdm=False)
        undisturbed = time.perf_counter() - began
        (pid,) = llm.llm_engine.statistics().worker_pids
        began = time.perf_counter()
        os.kill(pid, signal.SIGKILL)
        llm.generate("Paris is", one_token, use_tqdm=False)
        recovered = time.perf_counter() - began
        if llm.llm_engine.statistics().worker_restarts != 1:
            raise RuntimeError("the worker was not restarted after its SIGKILL")
    return {"first_start_s": first, "next_start_s": second, "recovery_s": recovered - undisturbed}


def measure_in_child(model: str | None, method: str) -> dict[str, float]:
    """``measure_here`` in a fresh interpreter whose workers start by ``method``."""
    code = (f"from triode.bench.worker_start import _print_measurement; _print_measurement({model!r})")
    environment = {**os.environ, "TRIODE_WORKER_MULTIPROC_METHOD": method}
    done = subprocess.run([sys.executable, "-c", code], env=environment, capture_output=True, text=True,
                          check=False)
    results = [line.removeprefix(_RESULT_PREFIX) for line in done.stdout.splitlines()
               if line.startswith(_RESULT_PREFIX)]
    if done.returncode != 0 or len(results) != 1:
        raise RuntimeError(f"the {method} round exited with status {done.returncode}:\n{done.stderr[-3000:]}")
    return json.loads(results[0])


def _print_measurement(model: str | None) -> None:
    print(_RESULT_PREFIX + json.dumps(measure_here(model)), flush=True)


def run(*, model: str | None = None, rounds: int = 2, output_dir: Path = Path("bench-results")) -> dict:
    print(f"triode bench start: engine start-up and recovery from a worker SIGKILL, workers forked from "
          f"the forkserver against spawned, {rounds} rounds alternated, the best counting; "
          f"{machine_description()}", flush=True)
    measured: dict[str, list[dict[str, float]]] = {method: [] for method in MULTIPROC_METHODS}
    turns = [method for _ in range(rounds) for method in MULTIPROC_METHODS]
    for method in tqdm(turns, desc="rounds", unit="round"):
        measured[method].append(measure_in_child(model, method))
    best = {method: {part: min(r[part] for r in results) for part in PARTS} for method, results in measured.items()}
    forkserver, spawn = best["forkserver"], best["spawn"]
    rows = [[part.removesuffix("_s").replace("_", " "), forkserver[part], spawn[part], spawn[part] / forkserver[part]]
            for part in PARTS]
    print_table(["seconds, best of rounds", "forkserver", "spawn", "spawn / forkserver"], rows)
    payload = {"model": model, "rounds": measured, "best": best}
    write_json(output_dir / "worker-start.json", payload)
    name = Path(model).name if model else "the default model"
    plot_bars(output_dir / "worker-start.png", title=f"Engine start and worker recovery, {name} (best of {rounds} rounds)",
              y_label="ms", groups=["first start", "next start", "recovery after SIGKILL"],
              series={method: [best[method][part] * 1e3 for part in PARTS] for method in MULTIPROC_METHODS})
    print(f"wrote {output_dir / 'worker-start.json'} and {output_dir / 'worker-start.png'}")
    return payload
