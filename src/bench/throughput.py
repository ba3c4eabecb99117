"""`triode bench throughput`: offline output tokens/s of LLM.generate against Hugging Face
`generate` (static left-padded batches, prompts in the given order), same workloads, same run,
on the device the engine's worker runs on. ``--shape`` runs a random-weight checkpoint of a
real model's shape (with the default model's tokenizer) instead of ``--model``: the 8B-shaped
W1v of issue 20, on a GPU."""

from __future__ import annotations

import contextlib
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import torch
from tqdm import tqdm

from triode.bench.random_models import copy_tokenizer, write_random_model
from triode.bench.report import (
    load_hf_reference,
    machine_description,
    plot_bars,
    print_table,
    write_json,
)
from triode.bench.workloads import Workload, make_workload
from triode.engine.config import EngineArgs
from triode.engine.engine_stats import EngineStatistics
from triode.engine.llm import LLM
from triode.engine.model_files.resolve import resolve_model
from triode.engine.outputs import RequestOutput
from triode.engine.sampling_params import SamplingParams


class TimedRun(NamedTuple):
    seconds: float
    before: EngineStatistics
    after: EngineStatistics
    outputs: list[RequestOutput]


def timed_generate(llm: LLM, workload: Workload, params: list[SamplingParams] | None = None) -> TimedRun:
    """Runs the workload through ``llm`` (greedily, all its tokens, unless ``params`` say
    otherwise; they must still produce every token); the seconds, the statistics before and
    after, and the outputs."""
    if params is None:
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in workload.output_lens]
    before = llm.llm_engine.statistics()
    started = time.perf_counter()
    outputs = llm.generate(list(workload.prompts), params, use_tqdm=True)
    seconds = time.perf_counter() - started
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert produced == workload.total_output_tokens, (produced, workload.total_output_tokens)
    return TimedRun(seconds, before, llm.llm_engine.statistics(), outputs)


def run_triode(llm: LLM, workload: Workload) -> dict:
    seconds, before, after, _ = timed_generate(llm, workload)
    idle = after.worker_idle_seconds - before.worker_idle_seconds
    return {
        "seconds": seconds,
        "tokens_per_second": workload.total_output_tokens / seconds,
        "worker_idle_share": idle / seconds,
        "steps": after.steps - before.steps,
        "preemptions": after.num_preemptions - before.num_preemptions,
    }


def run_hf(model, workload: Workload, batch_size: int, pad_id: int) -> dict:
    """Static batches: each batch runs to its longest requested output; only requested
    tokens count as useful."""
    from transformers import GenerationConfig

    model.generation_config.eos_token_id = None  # ignore_eos, like the triode run
    started = time.perf_counter()
    generated = 0
    batches = range(0, len(workload.prompts), batch_size)
    for start in tqdm(batches, desc=f"HF {workload.name}", unit="batch"):
        prompts = workload.prompts[start : start + batch_size]
        longest = max(map(len, prompts))
        ids = torch.full((len(prompts), longest), pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, prompt in enumerate(prompts):
            ids[row, longest - len(prompt):] = torch.tensor(prompt)
            mask[row, longest - len(prompt):] = 1
        ids, mask = ids.to(model.device), mask.to(model.device)
        new_tokens = max(workload.output_lens[start : start + batch_size])
        config = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                  eos_token_id=None, pad_token_id=pad_id)
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=mask, generation_config=config)
        generated += (out.shape[1] - longest) * len(prompts)
    seconds = time.perf_counter() - started
    useful = workload.total_output_tokens
    return {
        "seconds": seconds,
        "tokens_per_second": useful / seconds,
        "wasted_share": 1 - useful / generated,
    }


def run(
    *,
    model: str | None,
    workloads: tuple[str, ...] = ("W1", "W1v"),
    hf_batch_size: int = 32,
    skip_hf: bool = False,
    dtype: str = "float32",
    shape: str | None = None,
    output_dir: Path = Path("bench-results"),
) -> dict:
    with contextlib.ExitStack() as stack:
        if shape is not None:
            scratch = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="triode-bench-throughput-")))
            args = EngineArgs.from_env(model=model)
            tokenizer = resolve_model(args.model, cache_dir=args.resolved_cache_dir()).path
            device = "cuda" if torch.cuda.is_available() else "cpu"
            model = str(copy_tokenizer(tokenizer, write_random_model(scratch / shape, shape, dtype=getattr(torch, dtype),
                                                                      device=device)))
        return _run(model=model, workloads=workloads, hf_batch_size=hf_batch_size, skip_hf=skip_hf, dtype=dtype,
                    label=f"a random {shape} checkpoint" if shape else model or "the default model",
                    output_dir=output_dir)


def _run(*, model, workloads, hf_batch_size, skip_hf, dtype, label, output_dir) -> dict:
    print(f"triode bench throughput ({dtype}, both engines, {label}) on {machine_description()}")
    started = time.perf_counter()
    llm = LLM(model, kv_cache_memory="4GiB", max_model_len=1024, dtype=dtype)
    startup = time.perf_counter() - started
    print(f"engine start-up: {startup:.1f} s")
    results: dict = {"startup_seconds": startup, "dtype": dtype, "workloads": {}}
    hf_model = None
    try:
        for name in workloads:
            workload = make_workload(name, vocab_size=llm.llm_engine.vocab_size)
            ours = run_triode(llm, workload)
            entry = {"triode": ours}
            if not skip_hf:
                if hf_model is None:
                    hf_model = load_hf_reference(llm.llm_engine.model_path, getattr(torch, dtype),
                                                 llm.llm_engine.supervisor.info.device)
                pad = llm.llm_engine.tokenizer.pad_token_id or 0
                entry["hf"] = run_hf(hf_model, workload, hf_batch_size, pad)
                entry["ratio"] = ours["tokens_per_second"] / entry["hf"]["tokens_per_second"]
            results["workloads"][name] = entry
    finally:
        llm.close()
    rows = []
    for name, entry in results["workloads"].items():
        hf = entry.get("hf")
        rows.append([
            name, entry["triode"]["tokens_per_second"],
            hf["tokens_per_second"] if hf else "-",
            f"{entry['ratio']:.2f}x" if hf else "-",
            f"{entry['triode']['worker_idle_share'] * 100:.1f}%",
            f"{hf['wasted_share'] * 100:.0f}%" if hf else "-",
        ])
    print_table(["workload", "triode tok/s", "HF tok/s", "triode/HF", "worker idle", "HF waste"], rows)
    suffix = "" if dtype == "float32" else f"-{dtype}"
    write_json(output_dir / f"throughput{suffix}.json", results)
    if not skip_hf:
        names = list(results["workloads"])
        plot_bars(
            output_dir / f"throughput{suffix}.png", title=f"Offline output tokens/s (greedy, {dtype})",
            y_label="output tokens / s", groups=names,
            series={
                "triode LLM.generate": [results["workloads"][n]["triode"]["tokens_per_second"] for n in names],
                "HF generate (static batches)": [results["workloads"][n]["hf"]["tokens_per_second"] for n in names],
            },
        )
    if "W1v" in results["workloads"] and not skip_hf:
        print(f"triode/HF throughput ratio: {results['workloads']['W1v']['ratio']:.1f}x")
    return results
