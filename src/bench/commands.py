"""`triode bench ...` subcommands; the CLI only mounts them."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from typing import NoReturn

from triode.engine.config import QUANTIZED_ACTIVATIONS

BENCH_EXTRA = ("matplotlib", "psutil", "httpx2")  # pyproject.toml's `bench` extra


MAX_COUNT = 1_000_000  # more is a typo: every request of a sweep is built before it starts


def count(text: str) -> int:
    """An argparse type: a whole number from 1 to MAX_COUNT (0 once fell back to a default, a
    negative one ran into a traceback after minutes of measuring)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if not 1 <= value <= MAX_COUNT:
        raise argparse.ArgumentTypeError(f"{value} is not a count from 1 to {MAX_COUNT}")
    return value


def usage_error(message: str) -> NoReturn:
    """Ends a bench command whose options cannot work together, as argparse ends a bad one: the
    message on stderr and exit status 2 (a failure while measuring exits 1)."""
    print(f"triode: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def missing_bench_extra() -> list[str]:
    """The packages of the ``bench`` extra this interpreter lacks (checked before a benchmark
    runs, not after minutes of measuring)."""
    return [name for name in BENCH_EXTRA if importlib.util.find_spec(name) is None]


def _step(namespace: argparse.Namespace) -> int:
    if namespace.overhead:
        from triode.bench import overhead

        overhead.run(model=namespace.model, batch_sizes=tuple(namespace.batch_sizes or (1, 64, 256)), max_tokens=namespace.steps or 64,
                     repeats=namespace.repeats, output_dir=Path(namespace.output_dir))
        return 0
    if namespace.lora:
        from triode.bench import lora

        lora.run(model=namespace.model, batch_sizes=tuple(namespace.batch_sizes or (1, 64)),
                 context=namespace.context, steps=namespace.steps or 32, rank=namespace.lora_rank,
                 adapters=namespace.lora_adapters, repeats=namespace.repeats, dtype=namespace.dtypes[0],
                 output_dir=Path(namespace.output_dir))
        return 0
    from triode.bench import step

    step.run(
        model=namespace.model,
        batch_sizes=tuple(namespace.batch_sizes or (1, 8, 32, 64)),
        context=namespace.context,
        steps=namespace.steps or 8,
        dtypes=tuple(namespace.dtypes),
        activations=tuple(namespace.quantized_activations),
        shape=namespace.shape,
        compare_eager=namespace.compare_eager,
        compare_batch_invariant=namespace.compare_batch_invariant,
        output_dir=Path(namespace.output_dir),
    )
    return 0


def _moe(namespace: argparse.Namespace) -> int:
    from triode.bench import moe

    shape = moe.MoEShape(experts=namespace.experts, top_k=namespace.top_k, expert_size=namespace.expert_size)
    moe.run(batch_sizes=tuple(namespace.batch_sizes), context=namespace.context, steps=namespace.steps,
            shape=shape, output_dir=Path(namespace.output_dir))
    return 0


def _attention(namespace: argparse.Namespace) -> int:
    from triode.bench import attention

    attention.run(repeats=namespace.repeats, output_dir=Path(namespace.output_dir))
    return 0


def _throughput(namespace: argparse.Namespace) -> int:
    compare = namespace.compare_async_scheduling or namespace.compare_batch_invariant
    if namespace.rounds is not None and not (compare or namespace.peer):
        usage_error("--rounds alternates two engines or settings: it takes --peer or --compare-*")
    if compare:
        from triode.bench import setting_compare

        setting_compare.run(
            setting="async_scheduling" if namespace.compare_async_scheduling else "batch_invariant",
            model=namespace.model, workloads=tuple(namespace.workloads), rounds=namespace.rounds or 2,
            dtype=namespace.dtype, output_dir=Path(namespace.output_dir))
        return 0
    if namespace.structured:
        from triode.bench import structured

        structured.run(model=namespace.model, dtype=namespace.dtype, output_dir=Path(namespace.output_dir))
        return 0
    if namespace.peer:
        from triode.bench import throughput_peer

        throughput_peer.run(model=namespace.model, workload_names=tuple(namespace.workloads), dtype=namespace.dtype,
                            defaults=not namespace.skip_defaults, output_dir=Path(namespace.output_dir),
                            rounds=namespace.rounds or 1)
        return 0
    from triode.bench import throughput

    throughput.run(
        model=namespace.model,
        workloads=tuple(namespace.workloads),
        hf_batch_size=namespace.hf_batch_size,
        skip_hf=namespace.skip_hf,
        dtype=namespace.dtype,
        shape=namespace.shape,
        output_dir=Path(namespace.output_dir),
    )
    return 0


def _start(namespace: argparse.Namespace) -> int:
    from triode.bench import worker_start

    worker_start.run(model=namespace.model, rounds=namespace.rounds, output_dir=Path(namespace.output_dir))
    return 0


def _tp(namespace: argparse.Namespace) -> int:
    from triode.bench import tp

    tp.run(
        model=namespace.model,
        sizes=tuple(namespace.sizes),
        num_prompts=namespace.num_prompts,
        max_tokens=namespace.max_tokens,
        kv_cache_memory=namespace.kv_cache_memory,
        output_dir=Path(namespace.output_dir),
    )
    return 0


def _spec(namespace: argparse.Namespace) -> int:
    from triode.bench import spec

    spec.run(model=namespace.model, speculative_config=namespace.speculative_config, rounds=namespace.rounds,
             max_tokens=namespace.max_tokens, concurrency=namespace.concurrency,
             output_dir=Path(namespace.output_dir), random_target=namespace.random_target)
    return 0


def _write_gguf(namespace: argparse.Namespace) -> int:
    from triode.bench import synthetic_gguf

    return synthetic_gguf.command(namespace)


def add_bench_commands(benches: argparse._SubParsersAction) -> None:
    step = benches.add_parser("step", help="decode step time: our runner vs Hugging Face forward")
    step.add_argument("--model", default=None)
    step.add_argument("--batch-sizes", type=count, nargs="+", default=None,
                      help="default: 1 8 32 64 (with --overhead: 1 64 256)")
    step.add_argument("--context", type=count, default=128, help="tokens in each sequence's context")
    step.add_argument("--steps", type=count, default=None,
                      help="decode steps timed per batch size (default: 8; with --overhead: the tokens each "
                           "request generates, 64)")
    from triode.bench.synthetic_gguf import SHAPES

    step.add_argument("--shape", choices=sorted(SHAPES), default=None,
                      help="time a random-weight checkpoint of this model's shape (bfloat16) instead of --model")
    step.add_argument("--compare-eager", action="store_true",
                      help="also the runner with --enforce-eager, and the weight-read limit per step")
    step.add_argument("--compare-batch-invariant", action="store_true",
                      help="also the runner with --batch-invariant (the first --dtypes and activations)")
    step.add_argument("--overhead", action="store_true",
                      help="the host cost of a step: LLM.generate on a 2-layer hidden-64 model, the wall time per "
                           "step less the forward, and where it goes, async scheduling off and on")
    step.add_argument("--lora", action="store_true",
                      help="what LoRA adapters cost the step: the base model, one adapter for every sequence, "
                           "and --lora-adapters mixed, in the same run")
    step.add_argument("--lora-rank", type=count, default=16, help="with --lora: the adapters' rank")
    step.add_argument("--lora-adapters", type=count, default=3, help="with --lora: adapters in the mixed batch")
    step.add_argument("--repeats", type=count, default=3,
                      help="with --overhead: best of this many runs; with --lora: median of this many")
    step.add_argument("--dtypes", nargs="+", default=["auto"],
                      help="one runner per dtype (auto keeps quantized weights on a CPU)")
    step.add_argument("--quantized-activations", nargs="+", default=["auto"], choices=QUANTIZED_ACTIVATIONS,
                      help="one runner per activation type, for runners that keep quantized weights (each "
                           "loaded with its own: integer activations interleave the weights on CPUs with "
                           "AVX2)")
    step.add_argument("--output-dir", default="bench-results")
    step.set_defaults(handler=_step)

    moe = benches.add_parser("moe", help="decode step time: a small MoE model vs a dense one of equal active "
                                         "parameters (random weights)")
    moe.add_argument("--batch-sizes", type=count, nargs="+", default=[1, 8, 32, 64])
    moe.add_argument("--context", type=count, default=128, help="tokens in each sequence's context")
    moe.add_argument("--steps", type=count, default=8, help="decode steps timed per batch size")
    moe.add_argument("--experts", type=count, default=8)
    moe.add_argument("--top-k", type=count, default=2)
    moe.add_argument("--expert-size", type=count, default=512, help="intermediate features of each expert")
    moe.add_argument("--output-dir", default="bench-results")
    moe.set_defaults(handler=_moe)

    attention = benches.add_parser("attention", help="CPU attention of a step: the batch-invariant decode "
                                                     "kernel for every row vs SDPA for prefill chunks")
    attention.add_argument("--repeats", type=count, default=3, help="timed runs of each step (after one warm-up)")
    attention.add_argument("--output-dir", default="bench-results")
    attention.set_defaults(handler=_attention)

    throughput = benches.add_parser(
        "throughput", help="offline throughput: LLM.generate vs Hugging Face generate (W1, W1v)"
    )
    throughput.add_argument("--model", default=None)
    throughput.add_argument("--workloads", nargs="+", default=["W1", "W1v"], choices=["W1", "W1v"])
    throughput.add_argument("--hf-batch-size", type=count, default=32)
    throughput.add_argument("--skip-hf", action="store_true", help="measure triode only")
    throughput.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                            help="weights and activations of both engines (the targets are float32)")
    throughput.add_argument("--peer", choices=["vllm"], default=None,
                            help="against vLLM's CPU build (installed once into an environment of its own) "
                                 "instead of HF: the same checkpoint, dtype and KV budget, then both defaults")
    throughput.add_argument("--skip-defaults", action="store_true",
                            help="with --peer: only the same-setting comparison")
    throughput.add_argument("--structured", action="store_true",
                            help="W1 with a JSON schema on every request vs W1 unconstrained")
    compare = throughput.add_mutually_exclusive_group()
    compare.add_argument("--compare-async-scheduling", action="store_true",
                         help="triode only, async scheduling off vs on, alternated round by round")
    compare.add_argument("--compare-batch-invariant", action="store_true",
                         help="triode only, --batch-invariant off vs on, alternated round by round")
    throughput.add_argument("--rounds", type=count, default=None,
                            help="turns each setting or engine takes, alternated, the best counting: with "
                                 "--compare-* (default 2) or --peer (default 1)")
    throughput.add_argument("--shape", choices=sorted(SHAPES), default=None,
                            help="a random-weight checkpoint of this model's shape (in --dtype) instead of --model")
    throughput.add_argument("--output-dir", default="bench-results")
    throughput.set_defaults(handler=_throughput)

    tp = benches.add_parser(
        "tp", help="tensor parallelism: W1 throughput, all-reduce time and load memory per rank, TP=1 vs TP=2"
    )
    tp.add_argument("--model", default=None)
    tp.add_argument("--sizes", type=count, nargs="+", default=[1, 2], help="tensor-parallel sizes to compare")
    tp.add_argument("--num-prompts", type=count, default=None, help="first N prompts of W1 (default: all 64)")
    tp.add_argument("--max-tokens", type=count, default=None, help="cap each output (default: 128)")
    tp.add_argument("--kv-cache-memory", default="2GiB", help="KV-cache budget per rank")
    tp.add_argument("--output-dir", default="bench-results")
    tp.set_defaults(handler=_tp)

    start = benches.add_parser(
        "start", help="engine start-up and recovery from a worker SIGKILL: workers forked from the forkserver "
                      "vs spawned"
    )
    start.add_argument("--model", default=None)
    start.add_argument("--rounds", type=count, default=2, help="turns each start method takes, alternated")
    start.add_argument("--output-dir", default="bench-results")
    start.set_defaults(handler=_start)

    spec = benches.add_parser(
        "spec", help="speculative decoding vs plain decoding: time between tokens at concurrency 1 (extractive "
                     "and free requests) and throughput at concurrency 32, with the acceptance")
    spec.add_argument("--model", default=None)
    spec.add_argument("--speculative-config", default=None,
                      help="the JSON object to measure (default: ngram, 8 tokens, lookup 2 to 5)")
    spec.add_argument("--rounds", type=count, default=2, help="turns each engine takes (the best counts)")
    spec.add_argument("--max-tokens", type=count, default=128, help="tokens per output at most")
    spec.add_argument("--concurrency", type=count, default=32)
    spec.add_argument("--random-target", choices=sorted(SHAPES), default=None,
                      help="a random-weight checkpoint of this shape as the model (e.g. the target of a draft "
                           "model: --speculative-config '{\"model\": \"default\", \"num_speculative_tokens\": 3}')")
    spec.add_argument("--output-dir", default="bench-results")
    spec.set_defaults(handler=_spec)

    from triode.bench.synthetic_gguf import FILE_TYPES

    write_gguf = benches.add_parser(
        "write-gguf", help="a GGUF file of a real model's shape with random weights (no download)"
    )
    write_gguf.add_argument("path", help="the .gguf file to write")
    write_gguf.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.1-8b")
    write_gguf.add_argument("--file-type", choices=FILE_TYPES, default="Q4_K_M")
    write_gguf.add_argument("--seed", type=int, default=0)
    write_gguf.set_defaults(handler=_write_gguf)
