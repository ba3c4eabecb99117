"""A concurrency sweep against a server started here or elsewhere: what ``triode bench serve``
and its ``--peer`` comparison share (start and stop a ``triode serve``, run the levels, draw
them on log-2 concurrency axes)."""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from triode.bench.peer_build import end_process

# A server's first answer may wait on its warm-up (a compile, a cache); one that accepts
# connections and never answers used to hold the sweep for the client's hour-long timeout.
FIRST_ANSWER_S = 300


async def sweep(ns: argparse.Namespace, base_url: str, levels: dict[int, list], *,
                request_fields: dict[str, Any] | None = None, label: str = "") -> dict[str, Any]:
    """Every level of ``levels`` against the server at ``base_url``, after one warm-up request,
    which must be answered within FIRST_ANSWER_S."""
    import httpx2
    import trio
    from tqdm import tqdm

    from triode.bench.load import one_request, open_client, run_level, served_model

    async with open_client(base_url, ns.api_key) as client:
        with trio.move_on_after(FIRST_ANSWER_S) as waited:
            try:
                model = ns.model_name or await served_model(client)
            except (httpx2.HTTPError, ValueError, LookupError) as e:
                raise SystemExit(f"triode: error: the server at {base_url} did not list its models "
                                 f"(GET /models): {type(e).__name__}: {e}") from None
            # First-request costs.
            warm = await one_request(client, model, levels[min(levels)][0], 4, request_fields)
        if waited.cancelled_caught:
            raise SystemExit(f"triode: error: the server at {base_url} did not answer a first request "
                             f"in {FIRST_ANSWER_S} s")
        if not warm.ok:
            raise SystemExit(f"triode: error: the server at {base_url} failed a request: {warm.error}")
        results = []
        for concurrency, chats in levels.items():
            with tqdm(total=len(chats), desc=f"{label}concurrency {concurrency}", unit="req") as progress:
                results.append(await run_level(client, model, chats, concurrency=concurrency,
                                               output_tokens=ns.output_tokens, progress=progress,
                                               request_fields=request_fields))
    return {"model": model, "levels": results}


def start_server(ns: argparse.Namespace, log_path: Path) -> tuple[subprocess.Popen, str]:
    command = [sys.executable, "-c", "import sys; from triode.frontend.cli import main; sys.exit(main())", "serve",
               *([ns.model] if ns.model else []), "--host", "127.0.0.1", "--port", "0",
               "--kv-cache-memory", str(ns.kv_cache_memory), "--max-model-len", str(ns.max_model_len),
               "--dtype", ns.dtype]
    with log_path.open("w") as log:  # the server writes to its own copy of the descriptor
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, text=True)
    print(f"starting triode serve (log: {log_path}) ...", flush=True)
    try:
        while process.poll() is None:
            for line in log_path.read_text().splitlines():
                if line.startswith("triode: serving ") and " at http://" in line:
                    url = line.split(" at ", 1)[1].split()[0]
                    return process, f"{url}/v1"
            time.sleep(0.2)
    except BaseException:  # Ctrl-C while it starts: the caller never got the process to stop
        stop_server(process)
        raise
    raise SystemExit(f"triode: error: the server exited ({process.returncode}); see {log_path}")


def stop_server(process: subprocess.Popen) -> None:
    """SIGTERM, which lets a server drain, and SIGKILL after a minute."""
    end_process(process, grace=60.0)




def save_sweep_figure(figure: Any, axes: Any, concurrency: list[int], path: Path) -> None:
    """Log-2 concurrency axes with a grid and legend on every axis, then the PNG."""
    from matplotlib import pyplot

    for axis in axes:
        axis.set_xscale("log", base=2)
        axis.set_xticks(concurrency, [str(v) for v in concurrency])
        axis.grid(True, alpha=0.3)
        axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    pyplot.close(figure)
