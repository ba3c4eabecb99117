"""`triode bench step --overhead`: what a decode step costs besides the model's arithmetic.

The real sync engine (``LLMEngine``, which ``LLM.generate`` drives; final outputs only, as
``generate`` asks for them) runs decode steps on a
model whose compute is negligible (two layers, hidden size 64, a few hundred tokens of
vocabulary, random weights) and on the default model, at each batch size, with asynchronous
scheduling off and on. Per step it reports the wall time and where it went:

- engine: the engine process's own work (schedule, apply the result, detokenize, outputs);
- round trip: what the supervisor's time for a step (from the later of the plan's sending
  and the result before it) has beyond the worker's: handing the plan over and the result
  back (pickling, the socket, the trio thread) where the worker waited for them;
- worker: the worker's whole step, and of it the host work around the forward (applying the
  plan, building the inputs and the sampler's tensors).

With asynchronous scheduling the engine's work overlaps the worker's, so the wall time is
less than the parts' sum.
"""

from __future__ import annotations

import random
import tempfile
import time
from pathlib import Path

import attrs
import torch
from tqdm import tqdm

from triode.bench.random_models import copy_tokenizer
from triode.bench.report import machine_description, plot_lines, print_table, write_json
from triode.engine.config import EngineArgs
from triode.engine.engine_stats import EngineStatistics
from triode.engine.llm_engine import LLMEngine
from triode.engine.model_files.resolve import resolve_model
from triode.engine.sampling_params import OutputKind, SamplingParams

PROMPT_TOKENS = 8
WARMUP_STEPS = 3  # the prefill and the first decodes (where the worker builds its caches)


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


def _per_step(before: EngineStatistics, after: EngineStatistics, steps: int, seconds: float) -> dict:
    worker = after.rank_step_seconds_total[0] - before.rank_step_seconds_total[0]
    supervised = after.step_seconds_total - before.step_seconds_total
    return {
        "total_ms": seconds / steps * 1e3,
        "engine_ms": (after.engine_seconds_total - before.engine_seconds_total) / steps * 1e3,
        "round_trip_ms": (supervised - worker) / steps * 1e3,
        "worker_ms": worker / steps * 1e3,
        "worker_prepare_ms": (after.worker_prepare_seconds_total - before.worker_prepare_seconds_total)
        / steps * 1e3,
        "steps_run": after.steps - before.steps,
    }


def time_decode_steps(engine: LLMEngine, batch: int, steps: int, vocab: int, *, seed: int) -> dict:
    """Per-step figures of ``steps`` decode steps with ``batch`` running sequences."""
    rng = random.Random(seed)
    # Final outputs only, as LLM.generate asks for them.
    params = SamplingParams(temperature=0.0, max_tokens=WARMUP_STEPS + steps + 2, ignore_eos=True,
                            output_kind=OutputKind.FINAL_ONLY)
    for i in range(batch):
        prompt = [rng.randrange(3, vocab) for _ in range(PROMPT_TOKENS)]
        engine.add_request(f"overhead-{seed}-{i}", {"prompt_token_ids": prompt}, params)
    for _ in range(WARMUP_STEPS):
        engine.step()
    before = engine.statistics()
    assert before.num_running == batch and before.num_waiting == 0, before
    started = time.perf_counter()
    for _ in range(steps):
        engine.step()
    seconds = time.perf_counter() - started
    after = engine.statistics()
    while engine.has_unfinished_requests():
        engine.step()
    return _per_step(before, after, steps, seconds)


@attrs.frozen(kw_only=True)
class _Model:
    label: str
    path: Path
    vocab: int
    steps: int


def run(
    *,
    model: str | None = None,
    batch_sizes: tuple[int, ...] = (1, 64, 256),
    steps: int = 64,
    model_steps: int = 16,
    modes: tuple[bool, ...] = (False, True),
    repeats: int = 3,
    output_dir: Path = Path("bench-results"),
) -> list[dict]:
    args = EngineArgs.from_env(model=model, max_num_seqs=max(batch_sizes), kv_cache_memory="1GiB")
    resolved = resolve_model(args.model, cache_dir=args.resolved_cache_dir())
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="triode-bench-overhead-") as scratch:
        tiny = write_tiny_model(Path(scratch) / "tiny", resolved.path)
        models = [_Model(label="tiny (2 layers, hidden 64, vocab 384)", path=tiny, vocab=384, steps=steps)]
        if model_steps:
            models.append(_Model(label=resolved.source, path=resolved.path, vocab=0, steps=model_steps))
        print(f"triode bench step --overhead: decode steps of LLMEngine at batch {list(batch_sizes)}, "
              f"best of {repeats}; async scheduling {[('on' if m else 'off') for m in modes]}; "
              f"{machine_description()}")
        configurations = [(m, mode) for m in models for mode in modes]
        for entry, mode in tqdm(configurations, desc="engines", unit="engine"):
            engine = LLMEngine(attrs.evolve(args, model=str(entry.path), async_scheduling=mode))
            try:
                vocab = entry.vocab or engine.supervisor.info.vocab_size
                for batch in batch_sizes:
                    runs = [time_decode_steps(engine, batch, entry.steps, vocab, seed=repeat)
                            for repeat in range(repeats)]
                    best = min(runs, key=lambda r: r["total_ms"])
                    rows.append({"model": entry.label, "async_scheduling": mode, "batch": batch, **best})
            finally:
                engine.close()
    print_table(
        ["model", "async", "batch", "total ms", "engine ms", "round trip ms", "worker ms", "of it host prep ms"],
        [[r["model"], "on" if r["async_scheduling"] else "off", r["batch"], r["total_ms"], r["engine_ms"],
          r["round_trip_ms"], r["worker_ms"], r["worker_prepare_ms"]] for r in rows],
    )
    write_json(output_dir / "step_overhead.json", {"batch_sizes": list(batch_sizes), "rows": rows})
    series = {
        f"{m.label.split(' (')[0]}, async {'on' if mode else 'off'}": [
            r["total_ms"] for r in rows if r["model"] == m.label and r["async_scheduling"] == mode]
        for m in models for mode in modes
    }
    plot_lines(output_dir / "step_overhead.png", title="Decode step time through LLMEngine",
               x_label="running sequences", y_label="ms per step", x=list(batch_sizes), series=series,
               log_x=True)
    print(f"wrote {output_dir / 'step_overhead.json'} and {output_dir / 'step_overhead.png'}")
    return rows
