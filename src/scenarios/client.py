"""The scenario load generator: plays a workload against a server with httpx2 under trio.
It sleeps while it waits (no busy polling), so it takes little CPU from the server."""

from __future__ import annotations

import json
import random

import attrs
import httpx2
import trio

from triode.scenarios.spec import Workload


@attrs.frozen(kw_only=True)
class RequestSpec:
    index: int
    body: dict
    path: str  # /v1/completions or /v1/chat/completions
    disconnect_after: int | None = None  # chunks read before the client leaves
    read_interval: float = 0.0  # a slow reader's pause between chunks


@attrs.define
class RequestResult:
    index: int
    status: int = 0  # HTTP status; 0: no response (connection refused or reset)
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None  # error message from the body or the SSE error event
    latency: float = 0.0
    first_token: float | None = None
    chunks: int = 0
    disconnected: bool = False
    slow: bool = False  # a deliberately slow reader: its latency is its own doing
    progress_times: list[float] = attrs.Factory(list)  # when output arrived (trio clock)


class Progress:
    """Output chunks all clients have received so far: faults wait for a count of them, so
    they land mid-stream however fast the machine is, instead of at a guessed second."""

    def __init__(self) -> None:
        self.chunks = 0
        self._waiters: list[tuple[int, trio.Event]] = []

    def note(self) -> None:
        self.chunks += 1
        for threshold, event in self._waiters:
            if self.chunks >= threshold:
                event.set()

    async def wait_for(self, chunks: int) -> None:
        if self.chunks >= chunks:
            await trio.lowlevel.checkpoint()
            return
        event = trio.Event()
        self._waiters.append((chunks, event))
        await event.wait()


def adapter_name(index: int) -> str:
    """The served name of a workload's ``index``-th LoRA adapter."""
    return f"lora-{index}"


def build_requests(workload: Workload) -> list[RequestSpec]:
    rng = random.Random(workload.seed)
    specs = []
    for index in range(workload.requests):
        max_tokens = rng.randint(*workload.max_tokens)
        if workload.prompts:
            prompt: str | list[int] = workload.prompts[index % len(workload.prompts)]
        else:
            prompt = [rng.randrange(1000, 30000) for _ in range(rng.randint(*workload.prompt_tokens))]
        body: dict = {"max_tokens": max_tokens, "temperature": workload.temperature,
                      "stream": workload.stream, "ignore_eos": True}
        if workload.lora_adapters and index % (workload.lora_adapters + 1) < workload.lora_adapters:
            body["model"] = adapter_name(index % (workload.lora_adapters + 1))
        if workload.api == "chat":
            text = prompt if isinstance(prompt, str) else " ".join(f"w{t}" for t in prompt)
            body["messages"] = [{"role": "user", "content": text}]
            path = "/v1/chat/completions"
        else:
            body["prompt"] = prompt
            path = "/v1/completions"
        specs.append(RequestSpec(index=index, body=body, path=path))
    return specs


def _delta_text(choice: dict) -> str:
    if "text" in choice:
        return choice["text"] or ""
    return (choice.get("delta") or choice.get("message") or {}).get("content") or ""


async def send(client: httpx2.AsyncClient, spec: RequestSpec, progress: Progress) -> RequestResult:
    result = RequestResult(index=spec.index, slow=spec.read_interval > 0)
    started = trio.current_time()
    try:
        if spec.body.get("stream"):
            await _stream(client, spec, result, started, progress)
        else:
            response = await client.post(spec.path, json=spec.body)
            result.status = response.status_code
            payload = response.json()
            if response.status_code == 200:
                result.progress_times.append(trio.current_time())
                choice = payload["choices"][0]
                result.text, result.finish_reason = _delta_text(choice), choice.get("finish_reason")
            else:
                result.error = (payload.get("error") or {}).get("message", response.text)
    except (httpx2.TransportError, json.JSONDecodeError) as e:
        result.error = result.error or f"{type(e).__name__}: {e}"
    result.latency = trio.current_time() - started
    return result


async def _stream(client: httpx2.AsyncClient, spec: RequestSpec, result: RequestResult, started: float,
                  progress: Progress) -> None:
    async with client.stream("POST", spec.path, json=spec.body) as response:
        result.status = response.status_code
        if response.status_code != 200:
            body = await response.aread()
            try:
                result.error = json.loads(body).get("error", {}).get("message", body.decode(errors="replace"))
            except (json.JSONDecodeError, AttributeError):
                result.error = body.decode(errors="replace")
            return
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                return
            event = json.loads(data)
            if "error" in event:
                result.error = event["error"].get("message", str(event["error"]))
                continue
            for choice in event.get("choices", []):
                text = _delta_text(choice)
                if text and result.first_token is None:
                    result.first_token = trio.current_time() - started
                result.text += text
                if text:
                    result.progress_times.append(trio.current_time())
                    progress.note()
                result.finish_reason = choice.get("finish_reason") or result.finish_reason
            result.chunks += 1
            if spec.disconnect_after is not None and result.chunks >= spec.disconnect_after:
                result.disconnected = True
                return  # leaving the block closes the connection mid-stream
            if spec.read_interval:
                await trio.sleep(spec.read_interval)


async def play(base_url: str, specs: list[RequestSpec], workload: Workload,
               progress: Progress | None = None) -> list[RequestResult]:
    """Fixed concurrency (``concurrency`` clients) or open-loop Poisson arrivals."""
    progress = progress if progress is not None else Progress()
    results: list[RequestResult] = []
    limits = httpx2.Limits(max_connections=max(workload.concurrency, 1) + 8)
    timeout = httpx2.Timeout(600.0, connect=10.0)
    async with httpx2.AsyncClient(base_url=base_url, limits=limits, timeout=timeout) as client:
        if workload.arrival_rate > 0:
            rng = random.Random(workload.seed + 1)
            async with trio.open_nursery() as nursery:
                for spec in specs:
                    nursery.start_soon(_record, client, spec, results, progress)
                    await trio.sleep(rng.expovariate(workload.arrival_rate))
        else:
            queue = list(reversed(specs))

            async def worker() -> None:
                while queue:
                    await _record(client, queue.pop(), results, progress)

            async with trio.open_nursery() as nursery:
                for _ in range(min(workload.concurrency, len(specs))):
                    nursery.start_soon(worker)
    return sorted(results, key=lambda r: r.index)


async def _record(client: httpx2.AsyncClient, spec: RequestSpec, results: list[RequestResult],
                  progress: Progress) -> None:
    results.append(await send(client, spec, progress))
