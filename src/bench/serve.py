"""``triode bench serve``: served throughput and latency over HTTP, against the same workload
run offline through ``LLM`` in the same invocation.

Fixed synthetic workload: single-turn chats of about 128 user tokens, 128 output tokens each
(greedy, ignore_eos), streamed. A concurrency sweep (1, 8, 32 by default) prints TTFT and
inter-token p50/p99, output tokens/s and requests/s per level, with a progress bar; writes
``serve.json`` and ``serve.png``. Without ``--base-url`` it starts ``triode serve`` itself (and
stops it before the offline run, so the two never share the CPU); with one, it measures any
OpenAI-compatible server (``ignore_eos`` is sent as an extra field, as vLLM accepts it). With
``--router N`` it compares one replica with N behind vllm-router instead (``router.py``)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from triode.bench.commands import count, usage_error
from triode.bench.sweep import save_sweep_figure, start_server, stop_server, sweep

ROUTER_POLICIES = ("round_robin", "cache_aware")  # the policies tests/test_router.py runs

SERVER_LOG = "serve-server.log"


def add_bench_serve(benches: argparse._SubParsersAction) -> None:
    p = benches.add_parser("serve", help="served throughput/latency over HTTP (concurrency sweep) vs offline LLM")
    p.add_argument("--base-url", default=None,
                   help="an OpenAI-compatible server, e.g. http://127.0.0.1:8000/v1 (default: start triode serve)")
    p.add_argument("--model", default=None, help="model to serve and to run offline (default: SmolLM2)")
    p.add_argument("--model-name", default=None, help="model name to send (default: the server's first model)")
    p.add_argument("--api-key", default="unused")
    p.add_argument("--concurrency", type=count, nargs="+", default=[1, 8, 32])
    p.add_argument("--num-prompts", type=count, default=None,
                   help="requests per level (default: max(8, 2 x concurrency))")
    p.add_argument("--prompt-tokens", type=count, default=128, help="user tokens per request (about)")
    p.add_argument("--output-tokens", type=count, default=128)
    p.add_argument("--kv-cache-memory", default="4GiB", help="for the started server and the offline run")
    p.add_argument("--max-model-len", type=count, default=1024, help="for the started server and the offline run")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="for the started server and the offline run (auto: as triode serve)")
    p.add_argument("--skip-offline", action="store_true", help="measure the server only")
    p.add_argument("--peer", choices=["llama.cpp"], default=None,
                   help="the same sweep against llama.cpp's server on the same GGUF file (--model, default: "
                        "the default model's), built once into an environment of its own")
    p.add_argument("--router", type=count, default=None, metavar="N",
                   help="start N replicas behind vllm-router and sweep one replica directly, then the router "
                        "(N=1: the router's own cost)")
    p.add_argument("--router-policy", default="round_robin", choices=ROUTER_POLICIES,
                   help="vllm-router's --policy for --router")
    p.add_argument("--output-dir", default="bench-results")
    p.set_defaults(handler=_command)


def _command(namespace: argparse.Namespace) -> int:
    if namespace.router is not None and (namespace.peer or namespace.base_url):
        usage_error("--router starts its own replicas: it takes no --peer or --base-url")
    if namespace.peer:
        from triode.bench import peer as bench_peer

        bench_peer.run(namespace)
    elif namespace.router is not None:
        from triode.bench import router as bench_router
        from triode.bench.report import machine_description

        output_dir = Path(namespace.output_dir)
        output_dir.mkdir(parents=True, exist_ok=True)
        print(f"triode bench serve --router {namespace.router} on {machine_description()}")
        bench_router.run(namespace, output_dir)
    else:
        run(namespace)
    return 0


def run(ns: argparse.Namespace) -> dict[str, Any]:
    import trio

    from triode.bench.load import conversations
    from triode.bench.report import machine_description, print_table, write_json

    output_dir = Path(ns.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    print(f"triode bench serve on {machine_description()}")
    levels = {c: conversations(ns.num_prompts or max(8, 2 * c), ns.prompt_tokens, seed=c) for c in ns.concurrency}
    server = None
    base_url = ns.base_url
    cpu_started = time.process_time()
    try:
        if base_url is None:
            server, base_url = start_server(ns, output_dir / SERVER_LOG)
        results = trio.run(sweep, ns, base_url, levels)
    finally:
        if server is not None:
            stop_server(server)
    client_cpu = time.process_time() - cpu_started
    report: dict[str, Any] = {
        "base_url": ns.base_url or "triode serve (started by the command)",
        "workload": {"prompt_tokens": ns.prompt_tokens, "output_tokens": ns.output_tokens, "greedy": True,
                     "ignore_eos": True, "requests_per_level": {c: len(v) for c, v in levels.items()}},
        "levels": results["levels"],
        "model": results["model"],
        "client_cpu_seconds": client_cpu,
    }
    rows = [[r["concurrency"], r["requests"], r["failed"], r["output_tokens_per_second"], r["requests_per_second"],
             r["ttft_p50_ms"], r["ttft_p99_ms"], r["itl_p50_ms"], r["itl_p99_ms"], r["mean_prompt_tokens"],
             r["client_cpu_seconds"]] for r in results["levels"]]
    print_table(["conc", "reqs", "failed", "out tok/s", "req/s", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms",
                 "ITL p99 ms", "prompt tok", "client CPU s"], [[_cell(v) for v in row] for row in rows])
    if not ns.skip_offline:
        top = max(levels)
        served = next(r for r in results["levels"] if r["concurrency"] == top)["output_tokens_per_second"]
        # Offline as LLM runs by default (every request batched at once), and offline with
        # at most `top` sequences per step: the batches a server at that concurrency can form,
        # so the second ratio is what the HTTP layer costs.
        offline = _offline(ns, levels[top])
        capped = _offline(ns, levels[top], max_num_seqs=top)
        report["offline"], report["offline_capped"] = offline, capped
        report["served_over_offline"] = served / offline["output_tokens_per_second"]
        report["served_over_offline_capped"] = served / capped["output_tokens_per_second"]
        print(f"offline LLM.chat, same {len(levels[top])} requests: {offline['output_tokens_per_second']:.1f} "
              f"output tok/s all at once, {capped['output_tokens_per_second']:.1f} with at most {top} "
              f"sequences per step; served at concurrency {top}: {served:.1f} "
              f"({report['served_over_offline']:.1%} of offline, "
              f"{report['served_over_offline_capped']:.1%} of offline at {top} sequences)")
    print(f"load generator CPU time: {client_cpu:.1f} s in total (process_time of this client)")
    write_json(output_dir / "serve.json", report)
    _plot(output_dir / "serve.png", results["levels"], report.get("offline"), report.get("offline_capped"))
    print(f"wrote {output_dir / 'serve.json'} and {output_dir / 'serve.png'}")
    return report


def _cell(value: Any) -> Any:
    return "-" if value is None else value


def _offline(ns: argparse.Namespace, chats: list, **engine_args: Any) -> dict[str, Any]:
    from triode.engine.llm import LLM
    from triode.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=ns.output_tokens, ignore_eos=True)
    with LLM(ns.model, kv_cache_memory=ns.kv_cache_memory, max_model_len=ns.max_model_len,
             dtype=ns.dtype, **engine_args) as llm:
        started = time.perf_counter()
        outputs = llm.chat(chats, params, use_tqdm=True)
        seconds = time.perf_counter() - started
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"requests": len(chats), "seconds": seconds, "output_tokens_per_second": produced / seconds,
            **engine_args}


def _plot(path: Path, levels: list[dict[str, Any]], offline: dict[str, Any] | None,
          capped: dict[str, Any] | None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    x = [r["concurrency"] for r in levels]
    figure, (left, right) = pyplot.subplots(1, 2, figsize=(11, 4.5))
    left.plot(x, [r["output_tokens_per_second"] for r in levels], marker="o", label="served (HTTP, streaming)")
    if offline is not None:
        left.axhline(offline["output_tokens_per_second"], linestyle="--", color="gray", label="offline LLM")
    if capped is not None:
        left.axhline(capped["output_tokens_per_second"], linestyle=":", color="gray",
                     label=f"offline LLM, max {capped['max_num_seqs']} seqs")
    left.set(title="Output tokens/s", xlabel="concurrent clients", ylabel="tokens / s")
    for key, label in (("ttft_p50_ms", "TTFT p50"), ("ttft_p99_ms", "TTFT p99"), ("itl_p50_ms", "ITL p50"),
                       ("itl_p99_ms", "ITL p99")):
        right.plot(x, [r[key] if r[key] is not None else float("nan") for r in levels], marker="o", label=label)
    right.set(title="Latency", xlabel="concurrent clients", ylabel="ms", yscale="log")
    save_sweep_figure(figure, (left, right), x, path)
