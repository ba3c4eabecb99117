"""External faults: real signals to real processes, misbehaving clients, malformed input."""

from __future__ import annotations

import contextlib
import os
import signal

import httpx2
import trio

from triode.scenarios.server import ServerProcess

# Bodies (or whole requests) that must each get a 4xx, never a 5xx or a hang.
_MALFORMED: list[tuple[str, str, bytes, dict[str, str]]] = [
    ("POST", "/v1/completions", b"{not json", {"content-type": "application/json"}),
    ("POST", "/v1/completions", b'{"prompt": "hi", "max_tokens": "many"}', {"content-type": "application/json"}),
    ("POST", "/v1/completions", b'{"prompt": "hi", "max_tokens": -3}', {"content-type": "application/json"}),
    ("POST", "/v1/completions", b'{"prompt": "hi", "temperature": -1}', {"content-type": "application/json"}),
    ("POST", "/v1/completions", b'{"prompt": "hi", "top_p": 7}', {"content-type": "application/json"}),
    ("POST", "/v1/completions", b'{"prompt": "hi", "logprobs": 1000}', {"content-type": "application/json"}),
    ("POST", "/v1/completions", b'{"prompt": "hi", "model": "no-such-model"}', {"content-type": "application/json"}),
    ("POST", "/v1/completions", b'{"prompt": [1, 2, 999999999]}', {"content-type": "application/json"}),
    ("POST", "/v1/completions", b'{"max_tokens": 4}', {"content-type": "application/json"}),
    ("POST", "/v1/completions", b'{"prompt": "\xff\xfe broken utf-8"}', {"content-type": "application/json"}),
    ("POST", "/v1/completions", b"prompt=hi", {"content-type": "application/x-www-form-urlencoded"}),
    ("POST", "/v1/chat/completions", b'{"messages": []}', {"content-type": "application/json"}),
    ("POST", "/v1/chat/completions", b'{"messages": "hello"}', {"content-type": "application/json"}),
    ("POST", "/v1/chat/completions", b'{"messages": [{"role": "user"}]}', {"content-type": "application/json"}),
    ("POST", "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "n": 0}',
     {"content-type": "application/json"}),
    ("POST", "/v1/no-such-route", b"{}", {"content-type": "application/json"}),
    ("DELETE", "/v1/completions", b"", {}),
]


async def malformed_burst(base_url: str, count: int, statuses: list[int]) -> None:
    """Sends ``count`` malformed requests, 16 at a time; records each status (0: no answer)."""
    limiter = trio.CapacityLimiter(16)
    async with httpx2.AsyncClient(base_url=base_url, timeout=30.0) as client:

        async def one(index: int) -> None:
            method, path, body, headers = _MALFORMED[index % len(_MALFORMED)]
            async with limiter:
                try:
                    response = await client.request(method, path, content=body, headers=headers)
                    statuses.append(response.status_code)
                except httpx2.TransportError:
                    statuses.append(0)

        async with trio.open_nursery() as nursery:
            for index in range(count):
                nursery.start_soon(one, index)


async def sigkill_worker(server: ServerProcess) -> list[int]:
    """SIGKILLs every worker process the server reports; returns their pids."""
    pids = await server.worker_pids()
    if not pids:
        raise RuntimeError("the server reported no worker pids (triode:worker_pid)")
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return pids


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie is not a live worker: it only waits to be reaped by its parent.
    with contextlib.suppress(OSError), open(f"/proc/{pid}/stat") as stat:
        return stat.read().split(") ", 1)[1][0] != "Z"
    return True
