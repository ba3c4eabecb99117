"""`triode bench throughput --structured`: W1 with a JSON schema on every request against W1
unconstrained, in one engine, alternated so that a machine's drift hits both alike.

The schema asks for more array items than 128 tokens can hold, so every constrained request
runs its full 128 tokens (finish_reason "length") like the unconstrained ones (ignore_eos):
both runs produce the same number of tokens, through strings (large allowed sets) and JSON
punctuation (small ones). The share of step time the worker spent on grammars (filling
masks, applying them, advancing matchers) comes from the engine's statistics."""

from __future__ import annotations

from pathlib import Path

from triode.bench.report import machine_description, plot_bars, print_table, write_json
from triode.bench.throughput import timed_generate
from triode.bench.workloads import Workload, make_workload
from triode.engine.llm import LLM
from triode.engine.sampling_params import SamplingParams
from triode.engine.structured.params import StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 40},
        "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 24}, "minItems": 200},
    },
    "required": ["title", "year", "tags"],
    "additionalProperties": False,
}


def _measure(llm: LLM, workload: Workload, constrained: bool) -> dict:
    constraint = StructuredOutputsParams(json=SCHEMA)
    params = [SamplingParams(temperature=0.0, max_tokens=n, structured_outputs=constraint)
              for n in workload.output_lens] if constrained else None
    seconds, before, after, _ = timed_generate(llm, workload, params)
    step = after.rank_step_seconds_total[0] - before.rank_step_seconds_total[0]
    grammar = after.grammar_seconds_total - before.grammar_seconds_total
    return {"seconds": seconds, "tokens_per_second": workload.total_output_tokens / seconds,
            "grammar_share_of_step": grammar / step if step else 0.0}


def run(*, model: str | None, dtype: str = "float32", rounds: int = 2,
        output_dir: Path = Path("bench-results")) -> dict:
    print(f"triode bench throughput --structured ({dtype}) on {machine_description()}")
    runs: dict[str, list[dict]] = {"unconstrained": [], "json schema": []}
    with LLM(model, kv_cache_memory="4GiB", max_model_len=1024, dtype=dtype) as llm:
        workload = make_workload("W1", vocab_size=llm.llm_engine.vocab_size)
        _measure(llm, Workload(name="warm-up", prompts=workload.prompts[:4], output_lens=(8,) * 4), True)
        for _ in range(rounds):
            runs["unconstrained"].append(_measure(llm, workload, False))
            runs["json schema"].append(_measure(llm, workload, True))
    rows = [[f"W1 {name} (round {i + 1})", r["tokens_per_second"], f"{r['grammar_share_of_step'] * 100:.1f}%"]
            for name, results in runs.items() for i, r in enumerate(results)]
    best = {name: max(r["tokens_per_second"] for r in results) for name, results in runs.items()}
    ratio = best["json schema"] / best["unconstrained"]
    print_table(["run", "output tok/s", "grammar share of step"], rows)
    print(f"constrained / unconstrained throughput (best of {rounds}): {ratio * 100:.1f}%")
    results = {"dtype": dtype, "runs": runs, "best": best, "ratio": ratio}
    write_json(output_dir / "throughput-structured.json", results)
    plot_bars(output_dir / "throughput-structured.png",
              title=f"W1 output tokens/s, JSON schema on every request vs none ({dtype})",
              y_label="output tokens / s", groups=[f"round {i + 1}" for i in range(rounds)],
              series={name: [r["tokens_per_second"] for r in results] for name, results in runs.items()})
    return results
