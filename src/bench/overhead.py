"""`triode bench step --overhead`: the host cost of a step, what a GPU's step would wait on.

``LLM.generate`` runs batches of short prompts (8 tokens, ``max_tokens`` out, greedy,
``ignore_eos``) on a model whose compute is small (two layers, hidden size 64, a few hundred
tokens of vocabulary, random weights): prefill, decode steps and the final outputs, as a
user's call runs them, with asynchronous scheduling off (the CPU default) and on. Per step
it reports the wall time, the model's forward (what the device computes), and the host cost,
the rest, split into where it went:

- schedule: planning the step and handing it to the workers' thread (engine process);
- encode: pickling the plan; IPC: the supervisor's wait beyond the worker's step and the
  result's unpickling (sockets, thread hand-offs);
- prepare: the worker's host work around the forward (applying the plan, building the inputs
  and the sampler's tensors); sample: sampling;
- apply: applying the result to the scheduler (before the next step is sent); outputs:
  building ``RequestOutput``s (beside the next step), less detokenize: the tokenizer's
  decoding of the output text;
- other: the rest of the wall time (the worker's own loop, the engine's waits on wake-ups).

The outputs of a step are built while the worker runs the next one, and with asynchronous
scheduling the engine's other parts overlap the worker's too, so the parts can add up to more
than the wall time; "other" is then negative. Goals (issue 42): host cost at most 1.5 ms at
64 sequences and 3 ms at 256.
"""

from __future__ import annotations

import random
import tempfile
import time
from pathlib import Path

import torch
from tqdm import tqdm

from triode.bench.random_models import copy_tokenizer
from triode.bench.report import machine_description, plot_lines, print_table, write_json
from triode.engine.config import EngineArgs
from triode.engine.engine_stats import EngineStatistics
from triode.engine.llm import LLM
from triode.engine.model_files.resolve import resolve_model
from triode.engine.sampling_params import SamplingParams

PROMPT_TOKENS = 8
TINY_VOCAB = 384
GOALS_MS = {64: 1.5, 256: 3.0}
PARTS = ("schedule", "encode", "ipc", "prepare", "sample", "apply", "outputs", "detokenize", "other")


def write_tiny_model(directory: Path, tokenizer_dir: Path, *, vocab: int = 384) -> Path:
    """A 2-layer Llama of hidden size 64 with random weights and the default model's tokenizer
    (whose first ``vocab`` ids the model produces)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(config).save_pretrained(directory)
    return copy_tokenizer(tokenizer_dir, directory)


def per_step(before: EngineStatistics, after: EngineStatistics, seconds: float) -> dict:
    """Milliseconds per step of the wall time, the forward, the host cost and its parts."""
    steps = after.steps - before.steps

    def ms(field: str) -> float:
        return (getattr(after, field) - getattr(before, field)) / steps * 1e3

    worker = (after.rank_step_seconds_total[0] - before.rank_step_seconds_total[0]) / steps * 1e3
    total, forward = seconds / steps * 1e3, ms("worker_forward_seconds_total")
    detokenize, apply = ms("detokenize_seconds_total"), ms("apply_seconds_total")
    parts = {
        "schedule": ms("schedule_seconds_total"),
        "encode": ms("plan_encode_seconds_total"),
        "ipc": ms("step_seconds_total") - worker,
        "prepare": ms("worker_prepare_seconds_total"),
        "sample": ms("worker_sample_seconds_total"),
        "apply": apply,
        "outputs": ms("output_seconds_total") - apply - detokenize,
        "detokenize": detokenize,
    }
    parts["other"] = total - forward - sum(parts.values())
    return {"steps": steps, "total_ms": total, "forward_ms": forward, "host_ms": total - forward, **parts}


def time_generate(llm: LLM, batch: int, max_tokens: int, *, seed: int) -> dict:
    """Per-step figures of one ``generate`` of ``batch`` prompts."""
    rng = random.Random(seed)
    prompts = [{"prompt_token_ids": [rng.randrange(3, TINY_VOCAB) for _ in range(PROMPT_TOKENS)]}
               for _ in range(batch)]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    before = llm.llm_engine.statistics()
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - started
    assert sum(len(o.outputs[0].token_ids) for o in outputs) == batch * max_tokens
    return per_step(before, llm.llm_engine.statistics(), seconds)


def run(
    *,
    model: str | None = None,
    batch_sizes: tuple[int, ...] = (1, 64, 256),
    max_tokens: int = 64,
    modes: tuple[bool, ...] = (False, True),
    repeats: int = 3,
    output_dir: Path = Path("bench-results"),
) -> list[dict]:
    args = EngineArgs.from_env(model=model)  # its tokenizer, for the tiny model
    tokenizer = resolve_model(args.model, cache_dir=args.resolved_cache_dir()).path
    rows: list[dict] = []
    print(f"triode bench step --overhead: LLM.generate of {list(batch_sizes)} prompts of {PROMPT_TOKENS} tokens, "
          f"{max_tokens} out, on a 2-layer hidden-64 model, best of {repeats}; async scheduling "
          f"{[('on' if m else 'off') for m in modes]}; {machine_description()}")
    with tempfile.TemporaryDirectory(prefix="triode-bench-overhead-") as scratch:
        tiny = write_tiny_model(Path(scratch) / "tiny", tokenizer, vocab=TINY_VOCAB)
        for mode in tqdm(modes, desc="engines", unit="engine"):
            with LLM(str(tiny), max_num_seqs=max(batch_sizes), kv_cache_memory="1GiB", async_scheduling=mode) as llm:
                time_generate(llm, 8, 8, seed=-1)  # the worker's first steps build its caches
                for batch in batch_sizes:
                    runs = [time_generate(llm, batch, max_tokens, seed=r) for r in range(repeats)]
                    best = min(runs, key=lambda r: r["total_ms"])
                    rows.append({"async_scheduling": mode, "batch": batch, **best})
    _print(rows)
    write_json(output_dir / "step_overhead.json", {"batch_sizes": list(batch_sizes), "max_tokens": max_tokens,
                                                   "goals_ms": GOALS_MS, "rows": rows})
    plot_lines(output_dir / "step_overhead.png", title="Host cost of a step through LLM.generate (2-layer model)",
               x_label="sequences", y_label="ms per step", x=list(batch_sizes), log_x=True,
               series={f"{label}, async {'on' if mode else 'off'}": [r[key] for r in rows if r["async_scheduling"] == mode]
                       for mode in modes for key, label in (("total_ms", "wall"), ("host_ms", "host"))})
    print(f"wrote {output_dir / 'step_overhead.json'} and {output_dir / 'step_overhead.png'}")
    return rows


def _print(rows: list[dict]) -> None:
    print_table(["async", "seqs", "steps", "wall ms", "forward", "host", "goal", *PARTS],
                [["on" if r["async_scheduling"] else "off", r["batch"], r["steps"], r["total_ms"], r["forward_ms"],
                  r["host_ms"], _goal(r), *(r[part] for part in PARTS)] for r in rows])


def _goal(row: dict) -> str:
    goal = GOALS_MS.get(row["batch"])
    return "-" if goal is None else f"<= {goal}: {'met' if row['host_ms'] <= goal else 'NOT met'}"
