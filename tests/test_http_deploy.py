"""HTTP tests: deployment. ``hypercorn --worker-class trio triode.frontend:app`` serves the model
named by TRIODE_MODEL (with the other TRIODE_* settings) and stops cleanly on SIGTERM; plain
``hypercorn triode.frontend:app`` (the asyncio worker) refuses to start, naming ``--worker-class
trio``, instead of answering 500s; and the default model gives a realistic chat answer."""

from __future__ import annotations

import socket

import httpx2
import openai
import pytest
import torch

from tests.http_server import BIN, ServerProcess, alive, running, triode_serve, wait_until
from tests.process_tree import descendants


def hypercorn(*flags: str, model, tmp_path, **env: str) -> ServerProcess:
    # From an empty directory, so `frontend` is the installed package, as in a deployment.
    return ServerProcess([str(BIN / "hypercorn"), *flags, "--bind", "127.0.0.1:0", "triode.frontend:app"],
                         env={"TRIODE_MODEL": str(model), "TRIODE_KV_CACHE_MEMORY": "64MiB", **env},
                         cwd=tmp_path)


def test_hypercorn_trio_worker_serves_the_app(tiny_model_factory, tmp_path):
    model = tiny_model_factory("llama")
    server = hypercorn("--worker-class", "trio", model=model, tmp_path=tmp_path,
                       TRIODE_SERVED_MODEL_NAME="tiny", TRIODE_API_KEY="k1,k2")
    with running(server) as s:
        assert httpx2.get(f"{s.url}/health").status_code == 200
        assert httpx2.get(f"{s.url}/v1/models").status_code == 401
        with openai.OpenAI(base_url=f"{s.url}/v1", api_key="k2", max_retries=0) as client:
            out = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=4)
        assert out.usage.completion_tokens <= 4 and out.choices[0].finish_reason in ("stop", "length")
        processes = descendants(s.pid, helpers=True)
        assert s.stop() == 0
    wait_until(lambda: not any(alive(pid) for pid in processes), timeout=10, what="worker processes to exit")


@pytest.mark.parametrize("workers", [None, "0"])
def test_asyncio_worker_refuses_to_start(tiny_model_factory, tmp_path, workers):
    """Refused at start-up, before the model loads. (hypercorn 0.18's supervisor drops its
    worker's exit status, so with the default worker process hypercorn itself exits 0;
    in-process, ``--workers 0``, the failure is its exit status.)"""
    flags = ("--workers", workers) if workers else ()
    server = hypercorn(*flags, model=tiny_model_factory("llama"), tmp_path=tmp_path)
    code = server.wait_exit(60)
    assert "--worker-class trio" in server.output
    assert "Running on" not in server.output
    if workers == "0":
        assert code != 0


def test_a_model_that_cannot_load_fails_start_up(tmp_path):
    server = triode_serve(tmp_path / "no-such-model")
    assert server.wait_exit(60) == 2
    assert "could not start" in server.output and "no such model" in server.output
    assert "triode: serving" not in server.output


def test_a_port_out_of_range_and_a_missing_gpu_are_plain_errors(tiny_model_factory):
    """Each was a Python traceback: an OverflowError from bind(), an AssertionError from torch."""
    model = str(tiny_model_factory("llama"))
    server = ServerProcess([str(BIN / "triode"), "serve", model, "--port", "99999"])
    assert server.wait_exit(60) == 2
    assert "--port: 99999 is not a TCP port (0-65535)" in server.output and "Traceback" not in server.output
    # a size past any float (an OverflowError traceback), and one that is not a size (argparse
    # said "invalid parse_size value" without the reason)
    for size in ("1e400GiB", "12 parsecs"):
        server = ServerProcess([str(BIN / "triode"), "serve", model, "--kv-cache-memory", size])
        assert server.wait_exit(60) == 2
        assert f"--kv-cache-memory: '{size}' is not a size (e.g. 4096, 512MiB, 2GiB)" in server.output
        assert "Traceback" not in server.output
    if torch.cuda.is_available():
        return
    server = ServerProcess([str(BIN / "triode"), "serve", model, "--host", "127.0.0.1", "--port", "0",
                            "--device", "cuda"])
    assert server.wait_exit(60) == 2
    assert "--device cuda: this torch sees no CUDA device" in server.output and "Traceback" not in server.output


def test_a_port_in_use_fails_before_the_model_loads(tiny_model_factory):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        server = ServerProcess([str(BIN / "triode"), "serve", str(tiny_model_factory("llama")), "--host",
                                "127.0.0.1", "--port", str(port)])
        assert server.wait_exit(60) == 2
    assert "Address already in use" in server.output and "loading" not in server.output


@pytest.mark.slow
@pytest.mark.default_model
def test_default_model_answers_a_chat():
    with running(triode_serve(None, "--kv-cache-memory", "256MiB", "--max-model-len", "1024"),
                 timeout=600) as server:
        with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as client:
            [model] = client.models.list().data
            assert model.id == "SmolLM2-135M-Instruct"
            messages = [{"role": "user", "content": "What is the capital of France?"}]
            out = client.chat.completions.create(model=model.id, messages=messages, max_tokens=24,
                                                 temperature=0)
            streamed = "".join(chunk.choices[0].delta.content or ""
                               for chunk in client.chat.completions.create(
                                   model=model.id, messages=messages, max_tokens=24, temperature=0,
                                   stream=True)
                               if chunk.choices)
    answer = out.choices[0].message.content
    assert answer.startswith("The capital of France is Paris."), answer
    assert streamed == answer
