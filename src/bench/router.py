"""``triode bench serve --router N``: the same sweep against one replica directly and against N
replicas behind vllm-router, in one invocation.

It starts N ``triode serve`` replicas and ``vllm-router`` in front of them (``--router-policy``,
round_robin by default), runs the concurrency sweep against replica 0 directly (the baseline),
then through the router, and prints the two side by side with the router's cost in TTFT and
inter-token latency. On a machine whose cores the replicas share, N > 1 measures the router's
overhead and correctness, not a speed-up: use N = 1 for the router's own cost. Writes
``router.json`` and ``router.png``."""

from __future__ import annotations

import argparse
import contextlib
import functools
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2

from triode.bench.commands import usage_error
from triode.bench.sweep import save_sweep_figure, start_server, stop_server, sweep
from triode.scenarios.server import free_port


def router_binary() -> str:
    """vllm-router from this environment (the test extra installs it), else from PATH."""
    beside = Path(sys.executable).parent / "vllm-router"
    found = str(beside) if beside.exists() else shutil.which("vllm-router")
    if found is None:
        usage_error("--router needs vllm-router: pip install vllm-router (x86-64 Linux)")
    return found


@contextlib.contextmanager
def running_router(worker_urls: list[str], policy: str, log_path: Path, *flags: str) -> Iterator[str]:
    """vllm-router on a free loopback port in front of ``worker_urls`` (``flags``: more of its
    own); yields its base URL once it is ready."""
    port = free_port()
    command = [router_binary(), "--worker-urls", *worker_urls, "--policy", policy, "--host", "127.0.0.1",
               "--port", str(port), "--prometheus-port", str(free_port()), "--worker-startup-check-interval", "1",
               *flags]
    with log_path.open("w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    print(f"starting vllm-router ({policy}, {len(worker_urls)} replicas; log: {log_path}) ...", flush=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            if process.poll() is not None:
                raise SystemExit(f"triode: error: vllm-router exited ({process.returncode}); see {log_path}")
            with contextlib.suppress(httpx2.TransportError):
                if httpx2.get(f"{url}/readiness", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise SystemExit(f"triode: error: vllm-router was not ready in 60 s; see {log_path}")
            time.sleep(0.2)
        yield url
    finally:
        stop_server(process)


def run(ns: argparse.Namespace, output_dir: Path) -> dict[str, Any]:
    import trio

    from triode.bench.load import conversations
    from triode.bench.report import print_table, write_json

    # Three workloads of the same shape with different texts (a pass must not find another's
    # prompts in the prefix cache): an untimed warm-up at the top concurrency, so that the
    # first measured pass does not pay what a fresh server pays once, then the two passes.
    warm_up, *passes = [{c: conversations(ns.num_prompts or max(8, 2 * c), ns.prompt_tokens, seed=c + offset)
                         for c in ns.concurrency} for offset in (20_000, 0, 10_000)]
    top = max(ns.concurrency)

    replicas: list[subprocess.Popen] = []
    try:
        urls = []
        for index in range(ns.router):
            process, url = start_server(ns, output_dir / f"router-replica-{index}.log")
            replicas.append(process)
            urls.append(url)
        for url in urls:
            trio.run(functools.partial(sweep, ns, url, {top: warm_up[top]}, label="warm-up "))
        direct = trio.run(functools.partial(sweep, ns, urls[0], passes[0], label="direct "))
        with running_router([u.removesuffix("/v1") for u in urls], ns.router_policy,
                            output_dir / "router.log") as router_url:
            routed = trio.run(functools.partial(sweep, ns, f"{router_url}/v1", passes[1], label="router "))
    finally:
        for process in replicas:
            stop_server(process)
    rows = []
    for one, many in zip(direct["levels"], routed["levels"], strict=True):
        rows.append([one["concurrency"], one["failed"] + many["failed"], one["output_tokens_per_second"],
                     many["output_tokens_per_second"], one["ttft_p50_ms"], many["ttft_p50_ms"],
                     _minus(many["ttft_p50_ms"], one["ttft_p50_ms"]), one["itl_p50_ms"], many["itl_p50_ms"],
                     _minus(many["itl_p50_ms"], one["itl_p50_ms"])])
    print(f"one replica directly vs {ns.router} behind vllm-router ({ns.router_policy}), same workload:")
    print_table(["conc", "failed", "direct tok/s", "router tok/s", "direct TTFT p50", "router TTFT p50",
                 "TTFT +ms", "direct ITL p50", "router ITL p50", "ITL +ms"],
                [["-" if v is None else v for v in row] for row in rows])
    report = {"replicas": ns.router, "policy": ns.router_policy, "direct": direct["levels"],
              "router": routed["levels"], "model": direct["model"]}
    write_json(output_dir / "router.json", report)
    _plot(output_dir / "router.png", direct["levels"], routed["levels"], ns.router, ns.router_policy)
    print(f"wrote {output_dir / 'router.json'} and {output_dir / 'router.png'}")
    return report


def _minus(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else round(a - b, 2)


def _plot(path: Path, direct: list[dict[str, Any]], routed: list[dict[str, Any]], replicas: int,
          policy: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    x = [r["concurrency"] for r in direct]
    figure, (left, right) = pyplot.subplots(1, 2, figsize=(11, 4.5))
    routed_label = f"{replicas} replica{'s' if replicas > 1 else ''} via vllm-router ({policy})"
    for levels, label in ((direct, "1 replica, direct"), (routed, routed_label)):
        left.plot(x, [r["output_tokens_per_second"] for r in levels], marker="o", label=label)
        right.plot(x, [r["ttft_p50_ms"] or float("nan") for r in levels], marker="o", label=f"TTFT p50, {label}")
    left.set(title="Output tokens/s", xlabel="concurrent clients", ylabel="tokens / s")
    right.set(title="Time to first token", xlabel="concurrent clients", ylabel="ms", yscale="log")
    save_sweep_figure(figure, (left, right), x, path)
