"""The load generator of ``triode bench serve``: N concurrent streaming chat clients on trio.

It shares the machine with the server it measures, so it must stay light: every client
sleeps in the socket (trio + httpx, no busy polling), and the generator reports its own CPU
time so a reader can check it did not steal the server's. The clients speak the wire format
(``POST /chat/completions``, server-sent events) directly: through the openai SDK, which
builds a typed object per chunk, the clients used 1.85 s of CPU at concurrency 32 (8,192
chunks), the server's own process 1.33 s, and every step of the server's worker took 10%
longer than offline."""

from __future__ import annotations

import json
import random
import statistics
import time
from collections.abc import Sequence
from typing import Any

import attrs
import httpx2
import trio

# Short, common English words: about one token each in the usual BPE vocabularies.
_WORDS = (
    "the of and to in is you that it he was for on are as with his they at be this have from or one had by "
    "word but not what all were we when your can said there use an each which she do how their if will up "
    "other about out many then them these so some her would make like him into time has look two more write "
    "go see number no way could people my than first water been call who oil its now find long down day did "
    "get come made may part over new sound take only little work know place year live me back give most very "
    "after thing our just name good sentence man think say great where help through much before line right "
    "too mean old any same tell boy follow came want show also around form three small set put end does "
    "another well large must big even such because turn here why ask went men read need land different home"
).split()


def conversations(count: int, prompt_tokens: int, *, seed: int = 0) -> list[list[dict[str, str]]]:
    """``count`` single-turn chats of about ``prompt_tokens`` tokens of user text each (the chat
    template adds its own); different text per request, so no prefix is shared beyond it."""
    rng = random.Random(seed)
    chats = []
    for index in range(count):
        words = [rng.choice(_WORDS) for _ in range(max(prompt_tokens - 8, 1))]
        chats.append([{"role": "user", "content": f"Request {index}: " + " ".join(words)}])
    return chats


@attrs.frozen(kw_only=True)
class RequestResult:
    ok: bool
    seconds: float
    ttft: float | None = None
    gaps: tuple[float, ...] = ()  # between content chunks
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None


def open_client(base_url: str, api_key: str | None) -> httpx2.AsyncClient:
    """A client for an OpenAI-compatible ``base_url`` (ending in ``/v1``), enough connections
    for any concurrency, no retries, and a connection per request: llama-server (0.3.36's)
    closes a kept-alive connection after some streamed responses without saying so, and the
    next request sent on it fails without a response (2 to 5 of 30 here). Every server gets
    the same; a loopback connect costs about 0.1 ms."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return httpx2.AsyncClient(base_url=base_url.rstrip("/"), headers=headers, timeout=3600,
                              limits=httpx2.Limits(max_connections=None, max_keepalive_connections=0))


async def served_model(client: httpx2.AsyncClient) -> str:
    response = await client.get("/models")
    response.raise_for_status()
    return response.json()["data"][0]["id"]


# What makes a server produce exactly max_tokens: vLLM's and triode's field. A server without
# it (llama.cpp's) gets its own equivalent through run_level's ``request_fields``.
IGNORE_EOS = {"ignore_eos": True}


async def one_request(client: httpx2.AsyncClient, model: str, messages: list[dict[str, str]],
                      output_tokens: int, request_fields: dict[str, Any] | None = None) -> RequestResult:
    started = trio.current_time()
    first = last = None
    chunks = 0
    gaps: list[float] = []
    usage: dict[str, int] = {}
    body = {"model": model, "messages": messages, "max_tokens": output_tokens, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True},
            **(IGNORE_EOS if request_fields is None else request_fields)}
    error = None
    try:
        async with client.stream("POST", "/chat/completions", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                return _failed(started, f"HTTP {response.status_code}: {response.text[:200]}")
            pending = b""
            # Read to the end even after an error event: leaving httpx's byte iterator early
            # abandons the generators under it.
            async for data in response.aiter_bytes():
                now = trio.current_time()
                events = (pending + data).replace(b"\r\n", b"\n").split(b"\n\n")
                pending = events.pop()
                for event in events:
                    if event.startswith(b"event: error"):
                        error = error or event.decode(errors="replace")[:200]
                    if error or not event.startswith(b"data: {"):
                        continue
                    chunk = json.loads(event[6:])
                    usage = chunk.get("usage") or usage
                    choices = chunk.get("choices")
                    if choices and choices[0].get("delta", {}).get("content"):
                        chunks += 1
                        if first is None:
                            first = now
                        else:
                            gaps.append(now - last)
                        last = now
    except (httpx2.HTTPError, ValueError) as e:
        return _failed(started, f"{type(e).__name__}: {e}")
    if error:
        return _failed(started, error)
    return RequestResult(
        ok=True, seconds=trio.current_time() - started,
        ttft=None if first is None else first - started, gaps=tuple(gaps),
        # A server that streams no usage (llama.cpp's) sends a token per content chunk.
        prompt_tokens=usage.get("prompt_tokens", 0), completion_tokens=usage.get("completion_tokens", chunks),
    )


def _failed(started: float, error: str) -> RequestResult:
    return RequestResult(ok=False, seconds=trio.current_time() - started, error=error)


async def run_level(client: httpx2.AsyncClient, model: str, chats: Sequence[list[dict[str, str]]], *,
                    concurrency: int, output_tokens: int, progress: Any = None,
                    request_fields: dict[str, Any] | None = None) -> dict[str, Any]:
    """Sends every chat with at most ``concurrency`` in flight; returns the level's figures."""
    results: list[RequestResult] = []
    pending = iter(chats)

    async def client_loop() -> None:
        for messages in pending:  # the iterator is shared: each client takes the next chat
            results.append(await one_request(client, model, messages, output_tokens, request_fields))
            if progress is not None:
                progress.update(1)

    cpu_started = time.process_time()
    started = trio.current_time()
    async with trio.open_nursery() as nursery:
        for _ in range(concurrency):
            nursery.start_soon(client_loop)
    seconds = trio.current_time() - started
    return summarize(results, concurrency=concurrency, seconds=seconds,
                     client_cpu_seconds=time.process_time() - cpu_started)


def percentile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def summarize(results: list[RequestResult], *, concurrency: int, seconds: float,
              client_cpu_seconds: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    gaps = [g for r in ok for g in r.gaps]
    output = sum(r.completion_tokens for r in ok)
    return {
        "concurrency": concurrency,
        "requests": len(results),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "seconds": seconds,
        "requests_per_second": len(ok) / seconds if seconds else 0.0,
        "output_tokens_per_second": output / seconds if seconds else 0.0,
        "mean_prompt_tokens": statistics.fmean(r.prompt_tokens for r in ok) if ok else 0.0,
        "mean_output_tokens": output / len(ok) if ok else 0.0,
        "ttft_p50_ms": _ms(percentile(ttfts, 50)),
        "ttft_p99_ms": _ms(percentile(ttfts, 99)),
        "itl_p50_ms": _ms(percentile(gaps, 50)),
        "itl_p99_ms": _ms(percentile(gaps, 99)),
        "client_cpu_seconds": client_cpu_seconds,
    }


def _ms(value: float | None) -> float | None:
    return None if value is None else value * 1000
