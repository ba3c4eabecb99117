"""HTTP tests: ``triode bench serve`` at a tiny scale (it starts its own server, sweeps two
concurrency levels, runs the same chats offline, and writes its JSON and PNG), and its load
generator's stream reading against a canned server on 127.0.0.1 (event streams cut at odd
places, CRLF line ends, an error event, an HTTP error), and servers that never answer or lack
the OpenAI routes."""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import subprocess

import pytest
import trio

from tests.http_server import BIN
from triode.bench.load import one_request, open_client
from triode.bench.sweep import FIRST_ANSWER_S, sweep


@pytest.mark.slow
def test_bench_serve_small(tiny_model_factory, tmp_path):
    model = tiny_model_factory("llama")
    result = subprocess.run(
        [str(BIN / "triode"), "bench", "serve", "--model", str(model), "--kv-cache-memory", "64MiB",
         "--max-model-len", "512", "--concurrency", "1", "3", "--num-prompts", "3", "--prompt-tokens", "16",
         "--output-tokens", "8", "--output-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "load generator CPU time" in result.stdout and "of offline" in result.stdout
    report = json.loads((tmp_path / "serve.json").read_text())
    assert [level["concurrency"] for level in report["levels"]] == [1, 3]
    for level in report["levels"]:
        assert level["failed"] == 0 and level["mean_output_tokens"] == 8
        assert level["ttft_p50_ms"] > 0 and level["itl_p99_ms"] >= level["itl_p50_ms"] > 0
    assert report["offline"]["output_tokens_per_second"] > 0 and report["served_over_offline"] > 0
    assert report["offline_capped"]["max_num_seqs"] == max(level["concurrency"] for level in report["levels"])
    assert report["served_over_offline_capped"] > 0
    assert (tmp_path / "serve.png").stat().st_size > 0


@pytest.mark.slow
@pytest.mark.skipif(not (BIN / "vllm-router").exists(), reason="vllm-router is installed on x86-64 Linux")
def test_bench_serve_through_the_router_small(tiny_model_factory, tmp_path):
    model = tiny_model_factory("llama")
    result = subprocess.run(
        [str(BIN / "triode"), "bench", "serve", "--router", "2", "--model", str(model), "--kv-cache-memory", "64MiB",
         "--max-model-len", "512", "--concurrency", "1", "4", "--num-prompts", "4", "--prompt-tokens", "16",
         "--output-tokens", "8", "--output-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "one replica directly vs 2 behind vllm-router (round_robin)" in result.stdout
    report = json.loads((tmp_path / "router.json").read_text())
    assert report["replicas"] == 2 and len(report["direct"]) == len(report["router"]) == 2
    for level in report["direct"] + report["router"]:
        assert level["failed"] == 0 and level["mean_output_tokens"] == 8 and level["ttft_p50_ms"] > 0
    assert (tmp_path / "router.png").stat().st_size > 0


def test_bench_serve_refuses_a_router_with_a_base_url():
    result = subprocess.run([str(BIN / "triode"), "bench", "serve", "--router", "1", "--base-url", "http://x/v1"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "--router starts its own replicas" in result.stderr


def _sse(*events: str, newline: str = "\n") -> bytes:
    return "".join(f"{event}{newline}{newline}" for event in events).encode()


def _chunk(content: str | None = None, usage: dict | None = None) -> str:
    choices = [] if content is None else [{"index": 0, "delta": {"content": content}}]
    return "data: " + json.dumps({"choices": choices, "usage": usage})


async def _serve_canned(status: str, body: bytes, *, piece: int, task_status=trio.TASK_STATUS_IGNORED):
    """Answers every request with ``body`` (chunked), written ``piece`` bytes at a time."""
    async def answer(stream: trio.SocketStream) -> None:
        request = b""
        while b"\r\n\r\n" not in request:
            request += await stream.receive_some(65536)
        head, _, received = request.partition(b"\r\n\r\n")
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length")))
        while len(received) < length:
            received += await stream.receive_some(65536)
        # A client that stops at an error event closes its end while we still write.
        with contextlib.suppress(trio.BrokenResourceError):
            await stream.send_all(f"HTTP/1.1 {status}\r\ncontent-type: text/event-stream\r\n"
                                  "transfer-encoding: chunked\r\nconnection: close\r\n\r\n".encode())
            for start in range(0, len(body), piece):
                data = body[start:start + piece]
                await stream.send_all(b"%x\r\n%s\r\n" % (len(data), data))
                await trio.sleep(0.001)
            await stream.send_all(b"0\r\n\r\n")
        await stream.aclose()

    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    task_status.started(listeners[0].socket.getsockname()[1])
    await trio.serve_listeners(answer, listeners)


async def _one(nursery: trio.Nursery, status: str, body: bytes, *, piece: int = 7):
    port = await nursery.start(functools.partial(_serve_canned, status, body, piece=piece))
    async with open_client(f"http://127.0.0.1:{port}/v1", "key") as client:
        return await one_request(client, "m", [{"role": "user", "content": "hi"}], 3)


@pytest.mark.parametrize("newline", ["\n", "\r\n"])
@pytest.mark.parametrize("piece", [5, 64, 4096])
async def test_load_generator_reads_streams_cut_anywhere(newline, piece):
    body = _sse(_chunk("a"), _chunk("b"), _chunk(""), _chunk("c"),
                _chunk(usage={"prompt_tokens": 9, "completion_tokens": 3, "total_tokens": 12}),
                "data: [DONE]", newline=newline)
    async with trio.open_nursery() as nursery:
        result = await _one(nursery, "200 OK", body, piece=piece)
        nursery.cancel_scope.cancel()
    assert result.ok, result.error
    assert (result.prompt_tokens, result.completion_tokens) == (9, 3)
    assert len(result.gaps) == 2 and result.ttft is not None  # three chunks with content


async def test_load_generator_records_error_events_and_statuses():
    error = json.dumps({"error": {"message": "boom", "type": "server_error", "param": None, "code": None}})
    async with trio.open_nursery() as nursery:
        streamed = await _one(nursery, "200 OK", _sse(_chunk("a"), f"event: error\ndata: {error}", "data: [DONE]"))
        refused = await _one(nursery, "503 Service Unavailable", b'{"error": {"message": "full"}}')
        nursery.cancel_scope.cancel()
    assert not streamed.ok and "boom" in streamed.error
    assert not refused.ok and refused.error.startswith("HTTP 503") and "full" in refused.error


def test_a_bench_without_its_extra_is_refused_before_measuring(monkeypatch, capsys):
    from triode.bench import commands
    from triode.frontend import cli

    real = commands.importlib.util.find_spec
    monkeypatch.setattr(commands.importlib.util, "find_spec",
                        lambda name, *args: None if name == "matplotlib" else real(name, *args))
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "step", "--model", "no-such-model"])
    assert exit_info.value.code == 2
    assert "triode bench needs matplotlib: pip install 'triode[bench]'" in capsys.readouterr().err


async def _hold_connections(*, task_status=trio.TASK_STATUS_IGNORED):
    """Accepts connections and never answers, as a wedged server does."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    task_status.started(listeners[0].socket.getsockname()[1])
    async def hold(stream: trio.SocketStream) -> None:
        await trio.sleep_forever()

    await trio.serve_listeners(hold, listeners)


async def test_a_server_that_never_answers_ends_the_sweep_in_minutes(autojump_clock):
    """It used to wait for the client's hour-long timeout before anything was said."""
    ns = argparse.Namespace(api_key=None, model_name=None, output_tokens=4)
    async with trio.open_nursery() as nursery:
        port = await nursery.start(_hold_connections)
        started = trio.current_time()
        with pytest.raises(SystemExit, match=rf"did not answer a first request in {FIRST_ANSWER_S} s"):
            await sweep(ns, f"http://127.0.0.1:{port}/v1", {1: [[{"role": "user", "content": "hi"}]]})
        assert trio.current_time() - started == pytest.approx(FIRST_ANSWER_S)
        nursery.cancel_scope.cancel()


async def _answer_not_found(*, task_status=trio.TASK_STATUS_IGNORED):
    """Answers every request 404, as a server without the OpenAI routes does."""
    async def answer(stream: trio.SocketStream) -> None:
        request = b""
        while b"\r\n\r\n" not in request:
            request += await stream.receive_some(65536)
        await stream.send_all(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
        await stream.aclose()

    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    task_status.started(listeners[0].socket.getsockname()[1])
    await trio.serve_listeners(answer, listeners)


async def test_a_server_without_the_models_route_is_named():
    ns = argparse.Namespace(api_key=None, model_name=None, output_tokens=4)
    async with trio.open_nursery() as nursery:
        port = await nursery.start(_answer_not_found)
        with pytest.raises(SystemExit, match=r"did not list its models \(GET /models\): HTTPStatusError"):
            await sweep(ns, f"http://127.0.0.1:{port}/v1", {1: [[{"role": "user", "content": "hi"}]]})
        nursery.cancel_scope.cancel()
