"""HTTP tests: request lifecycles end to end. A client that leaves (mid-stream or before a
non-streamed answer) aborts its request and its KV blocks are freed; a burst past
--max-queued-requests gets 503 with Retry-After while accepted requests finish; SIGTERM
drains (503 for new requests, in-flight ones finish or end with finish_reason "abort") and
the server exits 0 leaving no worker processes. The tiny model here has a 32768-token context
so that a long request cannot finish during a test."""

from __future__ import annotations

import signal

import httpx2
import openai
import pytest
import trio

from tests.http_server import alive, ametric, await_condition, running, triode_serve
from tests.process_tree import descendants

LONG = 30000  # tokens: a minute or more on the tiny model, past any drain window here

# Leaving a stream early (our disconnects, and the openai SDK after [DONE]) leaves httpx2's and
# the SDK's chained byte iterators unexhausted; trio warns when it finalizes them. Not our code.
pytestmark = pytest.mark.filterwarnings(
    r"ignore:Async generator '(openai|httpx2|httpcore2)\.[\w.]+' was garbage collected")


@pytest.fixture(scope="module")
def model(tiny_model_factory):
    return tiny_model_factory("llama", max_position_embeddings=32768)


@pytest.fixture(scope="module")
def url(model):
    flags = ["--served-model-name", "tiny", "--kv-cache-memory", "64MiB", "--max-queued-requests", "1"]
    with running(triode_serve(model, *flags)) as server:
        yield server.url


async def engine_idle(client: httpx2.AsyncClient, url: str) -> bool:
    return (await ametric(client, url, "vllm:kv_cache_usage_perc") == 0.0
            and await ametric(client, url, "vllm:num_requests_running") == 0.0)


STREAMS = {  # each API's endless streamed request
    "/v1/completions": {"prompt": "Hello", "max_tokens": LONG, "ignore_eos": True, "stream": True},
    "/v1/messages": {"model": "tiny", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": LONG,
                     "ignore_eos": True, "stream": True},
    "/v1/responses": {"model": "tiny", "input": "Hello", "max_output_tokens": LONG, "ignore_eos": True,
                      "stream": True},
}


@pytest.mark.parametrize("path", sorted(STREAMS))
async def test_disconnect_mid_stream_frees_kv_blocks(url, path):
    async with httpx2.AsyncClient(timeout=30) as client:
        aborted = await ametric(client, url, "vllm:request_success_total", finished_reason="abort")
        generated = await ametric(client, url, "vllm:generation_tokens_total")
        chunks = 0
        with trio.fail_after(30):
            async with client.stream("POST", f"{url}{path}", json=STREAMS[path]) as response:
                async for line in response.aiter_lines():
                    chunks += line.startswith("data: {")
                    if chunks == 5:
                        break
            # The response is closed without being read to the end: the connection is dropped.
        assert chunks == 5
        with trio.fail_after(20):
            await await_condition(lambda: engine_idle(client, url))
        assert await ametric(client, url, "vllm:request_success_total", finished_reason="abort") == aborted + 1
        assert await ametric(client, url, "vllm:generation_tokens_total") - generated < LONG / 2


@pytest.mark.parametrize("path", sorted(STREAMS))
async def test_disconnect_before_a_non_streamed_answer_frees_kv_blocks(url, path):
    async with httpx2.AsyncClient(timeout=30) as client:
        aborted = await ametric(client, url, "vllm:request_success_total", finished_reason="abort")

        async def running_now() -> bool:
            return await ametric(client, url, "vllm:num_requests_running") > 0

        async with trio.open_nursery() as nursery:
            cancel = trio.CancelScope()

            async def request() -> None:
                with cancel:
                    await client.post(f"{url}{path}", json={**STREAMS[path], "stream": False})
                    raise AssertionError("the request should have been cancelled")

            nursery.start_soon(request)
            with trio.fail_after(20):
                await await_condition(running_now)
            assert await ametric(client, url, "vllm:kv_cache_usage_perc") > 0
            cancel.cancel()  # the client gives up: httpx2 closes the connection
        with trio.fail_after(20):
            await await_condition(lambda: engine_idle(client, url))
        assert await ametric(client, url, "vllm:request_success_total", finished_reason="abort") == aborted + 1


async def test_overload_gets_503_with_retry_after(url):
    outcomes: list[tuple] = []
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as client:

        async def one(index: int) -> None:
            try:
                out = await client.completions.create(model="tiny", prompt=f"burst {index} " * 20, max_tokens=4,
                                                      extra_body={"ignore_eos": True})
            except openai.APIStatusError as e:
                outcomes.append((e.status_code, e.response.headers.get("retry-after"), e.body.get("code")))
            else:
                outcomes.append(("ok", out.choices[0].finish_reason, out.usage.completion_tokens))

        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                for index in range(48):
                    nursery.start_soon(one, index)
    rejected = [o for o in outcomes if o[0] != "ok"]
    accepted = [o for o in outcomes if o[0] == "ok"]
    assert rejected and accepted, outcomes
    assert set(rejected) == {(503, "1", "overloaded")}
    assert set(accepted) == {("ok", "length", 4)}


async def _all_gone(pids: set[int]) -> bool:
    return not any(alive(pid) for pid in pids)


@pytest.mark.slow
async def test_sigterm_drains_then_aborts_and_exits_cleanly(model):
    server = triode_serve(model, "--served-model-name", "tiny", "--kv-cache-memory", "64MiB",
                          "--shutdown-timeout", "4")
    url = await trio.to_thread.run_sync(server.wait_ready)
    try:
        workers = descendants(server.pid, helpers=True)
        assert workers
        results: dict[str, object] = {}
        streaming = trio.Event()
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as client, \
                httpx2.AsyncClient(timeout=30) as http:

            async def short() -> None:
                out = await client.completions.create(model="tiny", prompt="short", max_tokens=40,
                                                      extra_body={"ignore_eos": True})
                results["short"] = out.choices[0].finish_reason

            async def long() -> None:
                finish, tokens = None, 0
                async for chunk in await client.completions.create(
                        model="tiny", prompt="long", max_tokens=LONG, stream=True,
                        extra_body={"ignore_eos": True}):
                    streaming.set()
                    for choice in chunk.choices:
                        tokens += 1
                        finish = choice.finish_reason or finish
                results["long"] = (finish, tokens)

            async def draining() -> bool:
                return (await http.get(f"{url}/health")).status_code == 503

            with trio.fail_after(60):
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(long)
                    await streaming.wait()
                    nursery.start_soon(short)
                    await trio.sleep(0.2)  # let the short request reach the engine
                    server.process.send_signal(signal.SIGTERM)
                    await await_condition(draining)
                    response = await http.post(f"{url}/v1/completions", json={"prompt": "late", "max_tokens": 2})
                    assert response.status_code == 503 and response.json()["error"]["code"] == "draining"
                    assert response.headers["retry-after"]
        assert results["short"] == "length"
        finish, tokens = results["long"]
        assert finish == "abort" and tokens < LONG
        assert await trio.to_thread.run_sync(server.wait_exit, 30) == 0
        with trio.fail_after(10):
            await await_condition(lambda: _all_gone(workers))
        assert "draining" in server.output and "stopped" in server.output
    finally:
        if server.process.poll() is None:
            server.kill()

