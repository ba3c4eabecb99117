"""`triode bench spec`: speculative decoding against plain decoding in the same run: time
between tokens at concurrency 1 on extractive requests (repeat, edit or quote a given text;
edit given code) and on free generation, and output tokens/s at concurrency 32, with the
acceptance the engine counted. Two engines (with and without ``--speculative-config``) stay
up side by side and take turns, round by round, so a machine's drift hits both alike."""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

from triode.bench.random_models import copy_tokenizer, write_random_model
from triode.bench.report import machine_description, plot_bars, print_table, write_json
from triode.engine.config import EngineArgs
from triode.engine.llm import LLM
from triode.engine.model_files.resolve import resolve_model
from triode.engine.sampling_params import SamplingParams

TEXTS = [
    "The committee met on Tuesday to review the budget for the new library. After a long discussion, the "
    "members agreed to fund the reading room, the children's section and the archive, but postponed the "
    "decision on the cafe until the spring, when the final costs of the building will be known.",
    "To reset the router, unplug it from the wall, wait thirty seconds and plug it back in. When the light "
    "on the front turns green, open the settings page in a browser, sign in with the password printed on "
    "the label, and choose a new name and password for the wireless network.",
    "Photosynthesis turns light, water and carbon dioxide into sugar and oxygen. It takes place in the "
    "chloroplasts of plant cells, where chlorophyll absorbs mostly red and blue light and reflects green "
    "light, which is why leaves look green to us.",
]
CODE = '''def total_price(items, tax_rate):
    total = 0
    for item in items:
        total = total + item["price"] * item["quantity"]
    total = total + total * tax_rate
    return total


def average_price(items):
    if not items:
        return 0
    return sum(item["price"] for item in items) / len(items)
'''
EXTRACTIVE = [
    *(f"Repeat the following text exactly, word for word.\n\n{text}" for text in TEXTS),
    *(f"Rewrite the following text in the past tense, changing nothing else.\n\n{text}" for text in TEXTS[1:]),
    f"Rename the variable `total` to `amount` in this code and output the whole code.\n\n{CODE}",
    f"Add a docstring to each function of this code and output the whole code.\n\n{CODE}",
]
FREE = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain why the sky is blue to a ten-year-old.",
    "Write a poem about autumn in a big city.",
    "Give three tips for learning a new language, with an example for each.",
    "Describe your ideal weekend in detail.",
    "What are the pros and cons of working from home?",
]
DEFAULT_CONFIG = {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_min": 2, "prompt_lookup_max": 5}


def _messages(prompts: list[str]) -> list[list[dict[str, str]]]:
    return [[{"role": "user", "content": prompt}] for prompt in prompts]


def _time_per_output_token(llm: LLM, prompts: list[str], max_tokens: int) -> tuple[float, int]:
    """Mean seconds between tokens of the prompts run one at a time, and the tokens generated."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    gaps, tokens = [], 0
    for messages in _messages(prompts):
        (output,) = llm.chat(messages, params, use_tqdm=False)
        count = len(output.outputs[0].token_ids)
        metrics = output.metrics
        if count > 1 and metrics.first_token_time is not None and metrics.last_token_time is not None:
            gaps.append((metrics.last_token_time - metrics.first_token_time) / (count - 1))
        tokens += count
    return statistics.fmean(gaps), tokens


def _throughput(llm: LLM, prompts: list[str], max_tokens: int) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    started = time.perf_counter()
    outputs = llm.chat(_messages(prompts), params, use_tqdm=False)
    seconds = time.perf_counter() - started
    return sum(len(o.outputs[0].token_ids) for o in outputs) / seconds


def run(*, model: str | None, speculative_config: str | None, rounds: int, max_tokens: int,
        concurrency: int, output_dir: Path, random_target: str | None = None) -> dict:
    """``random_target``: a random-weight checkpoint of that shape (the default model's
    tokenizer) is the model, e.g. the target of a draft model."""
    config = json.loads(speculative_config) if speculative_config else DEFAULT_CONFIG
    if random_target is None:
        return _run(model, config, rounds, max_tokens, concurrency, output_dir, "default model" if model is None else model)
    with tempfile.TemporaryDirectory(prefix="triode-bench-spec-") as directory:
        target = write_random_model(Path(directory), random_target)
        copy_tokenizer(resolve_model(None, cache_dir=EngineArgs().resolved_cache_dir()).path, target)
        return _run(str(target), config, rounds, max_tokens, concurrency, output_dir, f"random {random_target}")


def _run(model: str | None, config: dict, rounds: int, max_tokens: int, concurrency: int, output_dir: Path,
         label: str) -> dict:
    print(f"triode bench spec ({json.dumps(config)}), {label}, on {machine_description()}")
    options = {"max_model_len": 1024, "kv_cache_memory": "1GiB"}
    busy = [*EXTRACTIVE, *FREE] * (concurrency // (len(EXTRACTIVE) + len(FREE)) + 1)
    results: dict[str, dict[str, list[float]]] = {name: {"plain": [], "spec": []}
                                                   for name in ("extractive", "free", f"concurrency {concurrency}")}
    with LLM(model, **options) as plain, LLM(model, speculative_config=config, **options) as spec:
        engines = {"plain": plain, "spec": spec}
        for llm in engines.values():  # warm-up: kernels, prefix cache, grammar-free paths
            _time_per_output_token(llm, EXTRACTIVE[:1] + FREE[:1], 16)
        counters = {}
        for round_index in range(rounds):
            for name, llm in engines.items():
                before = spec.llm_engine.statistics().spec_decode
                results["extractive"][name].append(_time_per_output_token(llm, EXTRACTIVE, max_tokens)[0])
                results["free"][name].append(_time_per_output_token(llm, FREE, max_tokens)[0])
                results[f"concurrency {concurrency}"][name].append(_throughput(llm, busy[:concurrency], max_tokens))
                print(f"round {round_index + 1}/{rounds}, {name}: done", flush=True)
                if name == "spec":
                    counters[round_index] = (before, spec.llm_engine.statistics().spec_decode)
    stats = spec.llm_engine.statistics().spec_decode
    best = {workload: {name: (min if workload != f"concurrency {concurrency}" else max)(values)
                       for name, values in runs.items()} for workload, runs in results.items()}
    speedups = {workload: (values["plain"] / values["spec"] if workload != f"concurrency {concurrency}"
                           else values["spec"] / values["plain"]) for workload, values in best.items()}
    rows = [[workload, f"{values['plain'] * 1000:.2f} ms" if "concurrency" not in workload
             else f"{values['plain']:.1f} tok/s",
             f"{values['spec'] * 1000:.2f} ms" if "concurrency" not in workload else f"{values['spec']:.1f} tok/s",
             f"{speedups[workload]:.2f}x"] for workload, values in best.items()]
    print_table(["workload", "plain", "speculative", "speed-up"], rows)
    assert stats is not None
    print(f"proposed tokens accepted: {stats.acceptance_rate or 0:.1%}; tokens per verification: "
          f"{stats.mean_acceptance_length or 0:.2f}; verifications: {stats.num_drafts}; by position: "
          f"{list(stats.accepted_per_position)}")
    payload = {"model": label, "speculative_config": config, "max_tokens": max_tokens, "concurrency": concurrency,
               "runs": results, "best": best, "speedup": speedups,
               "acceptance_rate": stats.acceptance_rate, "mean_acceptance_length": stats.mean_acceptance_length,
               "accepted_per_position": list(stats.accepted_per_position)}
    write_json(output_dir / "spec.json", payload)
    method = "a draft model" if "model" in config else "prompt lookup"
    plot_bars(output_dir / "spec.png", title=f"Speculative decoding ({method}, {label}): speed-up over plain",
              y_label="speed-up (x)", groups=list(speedups), series={"speculative / plain": list(speedups.values())})
    return payload
