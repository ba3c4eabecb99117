"""``triode bench serve --peer llama.cpp``: the serving sweep against triode and against
llama.cpp's C++ server (``llama_server.py``) on the same GGUF file, in one run.

Both servers get every core, are started by this command one after the other (never
sharing the CPU), and see the same chats; llama.cpp's chat API is given a logit bias of
-100 on every end-of-generation token of the file in place of ``ignore_eos``, and each
side's mean output length is reported so that a reader can check they produced the same
work. A peer that cannot be built or started is reported with its log, and triode's own
figures are still printed and written.

Next to the sweep it measures this machine's memory read bandwidth (before and after
triode's sweep, the higher kept) and the bytes of weights a decode step reads, so that the
batch-one time between tokens can be held to the limit the memory sets (weight bytes /
bandwidth), and the resident memory of the triode server's processes once they have answered
(PSS, so pages two processes share count once).
"""

from __future__ import annotations

import argparse
import functools
import time
from pathlib import Path
from typing import Any

from triode.bench.commands import usage_error
from triode.bench.llama_server import (
    PeerUnavailable,
    ensure_llama_server,
    llama_server_description,
    start_llama_server,
)
from triode.engine.cpus import usable_cpus
from triode.scenarios.server import free_port

PEER_LOG = "serve-peer-llama-cpp.log"
BUILD_LOG = "llama-server-build.log"


def run(ns: argparse.Namespace) -> dict[str, Any]:
    import trio

    from triode.bench.load import conversations
    from triode.bench.report import machine_description, write_json
    from triode.bench.sweep import start_server, stop_server, sweep
    from triode.engine.config import EngineArgs

    output_dir = Path(ns.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    cache_dir = EngineArgs.from_env().resolved_cache_dir()
    gguf_path = peer_gguf(ns.model, cache_dir)
    print(f"triode bench serve --peer llama.cpp on {machine_description()}\nmodel file: {gguf_path}")
    # Built before any measurement, so that the compile never shares the CPU with one.
    binary, peer_error = None, None
    try:
        binary = ensure_llama_server(Path(cache_dir), output_dir / BUILD_LOG)
    except PeerUnavailable as error:
        peer_error = str(error)
        print(f"triode: llama.cpp is left out: {peer_error}", flush=True)
    # Measured before and after triode's sweep, the best of both kept: on a shared machine the
    # bandwidth moves by a fifth within minutes, and the higher figure is the stricter limit.
    bandwidths = [read_bandwidth()]
    weight_bytes = decode_weight_bytes(gguf_path)
    print(f"memory read bandwidth {bandwidths[0] / 1e9:.1f} GB/s; a decode step reads {weight_bytes / 1e9:.3f} GB "
          f"of weights: at least {1000 * weight_bytes / bandwidths[0]:.1f} ms per token at batch one")
    levels = {c: conversations(ns.num_prompts or max(8, 2 * c), ns.prompt_tokens, seed=c) for c in ns.concurrency}
    ns.model = str(gguf_path)
    server, base_url = start_server(ns, output_dir / "serve-server.log")
    try:
        ours = trio.run(functools.partial(sweep, ns, base_url, levels, label="triode "))
        resident = resident_bytes(server.pid)
    finally:
        stop_server(server)
    bandwidths.append(read_bandwidth())
    bandwidth = max(bandwidths)
    print(f"memory read bandwidth after triode's sweep {bandwidths[1] / 1e9:.1f} GB/s")
    theirs = None
    if binary is not None:
        port = free_port()
        try:
            peer = start_llama_server(binary, gguf_path, slots=max(ns.concurrency), slot_tokens=ns.max_model_len,
                                      threads=usable_cpus(), port=port, log_path=output_dir / PEER_LOG)
        except PeerUnavailable as error:
            peer_error = str(error)
            print(f"triode: llama.cpp is left out: {peer_error}", flush=True)
        else:
            try:
                theirs = trio.run(functools.partial(sweep, ns, f"http://127.0.0.1:{port}/v1", levels,
                                                    request_fields=no_eos_bias(gguf_path), label="llama.cpp "))
            finally:
                stop_server(peer)
    report = {
        "model_file": str(gguf_path), "peer": llama_server_description(),
        "peer_error": peer_error,
        "workload": {"prompt_tokens": ns.prompt_tokens, "output_tokens": ns.output_tokens, "greedy": True,
                     "requests_per_level": {c: len(v) for c, v in levels.items()}},
        "memory_read_bandwidth_gb_s": bandwidth / 1e9, "decode_weight_bytes": weight_bytes,
        "memory_read_bandwidth_samples_gb_s": [b / 1e9 for b in bandwidths],
        "weight_read_limit_ms": 1000 * weight_bytes / bandwidth,
        "triode_resident_bytes": resident,
        "triode": ours["levels"], "llama_cpp": theirs["levels"] if theirs is not None else None,
    }
    _print_comparison(report)
    write_json(output_dir / "serve-peer.json", report)
    _plot(output_dir / "serve-peer.png", report)
    print(f"wrote {output_dir / 'serve-peer.json'} and {output_dir / 'serve-peer.png'}")
    return report


def peer_gguf(model: str | None, cache_dir: str) -> Path:
    """The GGUF file both servers load: ``model`` when it is one, else the default model's."""
    if model is not None and model != "default":
        path = Path(model).expanduser()
        if path.suffix.lower() != ".gguf" or not path.is_file():
            usage_error(f"--peer llama.cpp needs a .gguf file as --model (or none: the default model's), "
                        f"got {model!r}")
        return path.resolve()
    from triode.engine.model_files.resolve import resolve_model

    entry = resolve_model(None, cache_dir=cache_dir).path
    return next(entry.glob("*.gguf"))


def no_eos_bias(gguf_path: Path) -> dict[str, Any]:
    """llama.cpp's stand-in for ``ignore_eos``: its end-of-generation tokens made unpickable."""
    import gguf

    reader = gguf.GGUFReader(gguf_path)
    ids = set()
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        field = reader.fields.get(key)
        if field is not None:
            ids.add(int(field.parts[field.data[0]][0]))
    return {"logit_bias": {str(token): -100 for token in sorted(ids)}}


def decode_weight_bytes(gguf_path: Path) -> int:
    """Bytes of the matrices one decode step reads: every tensor but the embedding table, of
    which a step reads only its tokens' rows (unless it is also the LM head)."""
    import gguf

    reader = gguf.GGUFReader(gguf_path)
    names = {t.name for t in reader.tensors}
    tied = "output.weight" not in names
    return sum(int(t.n_bytes) for t in reader.tensors if t.name != "token_embd.weight" or tied)


def read_bandwidth(megabytes: int = 1024, repeats: int = 5) -> float:
    """Bytes per second a sum over a buffer far larger than the caches reads, best of a few,
    over a buffer in small pages and one in huge pages (where the worker puts weights,
    host_memory.weight_tensor; they read faster here): the higher, the stricter limit."""
    import torch

    from triode.engine.worker.host_memory import weight_tensor

    best = float("inf")
    for allocate in (torch.empty, weight_tensor):
        buffer = allocate([megabytes << 18], dtype=torch.float32).fill_(1.0)
        for _ in range(repeats):
            started = time.perf_counter()
            buffer.sum()
            best = min(best, time.perf_counter() - started)
        del buffer
    return (megabytes << 20) / best


def resident_bytes(pid: int) -> int:
    """Proportional set size of a process and its descendants (the workers)."""
    import psutil

    root = psutil.Process(pid)
    total = 0
    for process in (root, *root.children(recursive=True)):
        try:
            total += process.memory_full_info().pss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return total


def _print_comparison(report: dict[str, Any]) -> None:
    from triode.bench.report import print_table

    missing = {"output_tokens_per_second": None, "itl_p50_ms": None, "ttft_p50_ms": None,
               "mean_output_tokens": None, "failed": "-"}
    peer_levels = report["llama_cpp"] or [missing] * len(report["triode"])
    rows = []
    for ours, theirs in zip(report["triode"], peer_levels, strict=True):
        rows.append([ours["concurrency"], ours["output_tokens_per_second"], theirs["output_tokens_per_second"],
                     _ratio(ours["output_tokens_per_second"], theirs["output_tokens_per_second"]),
                     ours["itl_p50_ms"], theirs["itl_p50_ms"], ours["ttft_p50_ms"], theirs["ttft_p50_ms"],
                     ours["mean_output_tokens"], theirs["mean_output_tokens"],
                     f"{ours['failed']}/{theirs['failed']}"])
    print_table(["conc", "triode tok/s", "llama.cpp tok/s", "ratio", "triode ITL p50", "llama.cpp ITL p50",
                 "triode TTFT p50", "llama.cpp TTFT p50", "triode out", "llama.cpp out", "failed"],
                [["-" if v is None else v for v in row] for row in rows])
    first = report["triode"][0]
    if first["itl_p50_ms"] is not None:
        print(f"batch-one weight-read limit {report['weight_read_limit_ms']:.1f} ms per token; triode's ITL p50 "
              f"at concurrency {first['concurrency']} is {first['itl_p50_ms'] / report['weight_read_limit_ms']:.2f}x it")
    print(f"triode's server processes: {report['triode_resident_bytes'] / 2**30:.2f} GiB resident (PSS)")


    if report["peer_error"]:
        print(f"llama.cpp: not measured: {report['peer_error']}")


def _ratio(ours: float, theirs: float | None) -> float | None:
    return ours / theirs if theirs else None


def _plot(path: Path, report: dict[str, Any]) -> None:
    import matplotlib

    from triode.bench.sweep import save_sweep_figure

    matplotlib.use("Agg")
    from matplotlib import pyplot

    figure, (left, right) = pyplot.subplots(1, 2, figsize=(11, 4.5))
    for key, label in (("triode", "triode"), ("llama_cpp", "llama.cpp's llama-server")):
        levels = report[key]
        if levels is None:
            continue
        x = [r["concurrency"] for r in levels]
        left.plot(x, [r["output_tokens_per_second"] for r in levels], marker="o", label=label)
        right.plot(x, [r["itl_p50_ms"] if r["itl_p50_ms"] is not None else float("nan") for r in levels],
                   marker="o", label=f"{label}, ITL p50")
    right.axhline(report["weight_read_limit_ms"], linestyle=":", color="gray", label="weight bytes / bandwidth")
    left.set(title=f"Output tokens/s, {Path(report['model_file']).name}", xlabel="concurrent clients",
             ylabel="tokens / s")
    right.set(title="Time between tokens", xlabel="concurrent clients", ylabel="ms", yscale="log")
    save_sweep_figure(figure, (left, right), x, path)
