"""HTTP tests: ``/v1/embeddings`` through the real openai SDK against ``triode serve`` on a
tiny random ``Qwen3Model`` (a pooling model: last token, normalized), checked against Hugging
Face's hidden states (and a tiny BERT too); ``dimensions``, base64 and float encodings, ``truncate_prompt_tokens``;
errors in OpenAI's shape, an embedding request to a generation model and the reverse
included; the requests counted in the metrics; a client that hangs up frees the engine."""

from __future__ import annotations

import base64
import struct

import httpx2
import openai
import pytest
import torch
import torch.nn.functional as F
import trio

from tests.http_server import ametric, await_condition, metric, running, triode_serve
from tests.test_pooling_contract import hf_hidden
from tests.tiny_models import build_tiny_encoder

PROMPTS = ["The quick brown fox", "Paris is the capital of France.", "def add(a, b):"]


@pytest.fixture(scope="module")
def model(tiny_model_factory, tmp_path_factory):
    from transformers import AutoModel

    causal = tiny_model_factory("qwen3")
    directory = tmp_path_factory.mktemp("qwen3-embedding")
    AutoModel.from_pretrained(causal).save_pretrained(directory, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (directory / name).write_bytes((causal / name).read_bytes())
    return directory


@pytest.fixture(scope="module")
def server(model):
    flags = ["--served-model-name", "embedder", "--max-model-len", "128", "--kv-cache-memory", "16MiB",
             "--dtype", "float32"]
    with running(triode_serve(model, *flags)) as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    # Not strict: the SDK asks for base64 by default and validates before it decodes (as it
    # would against OpenAI's own answers).
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as client:
        yield client


def expected(model, tiny_tokenizer, prompt: str, dimensions: int | None = None) -> torch.Tensor:
    return F.normalize(hf_hidden(model, tiny_tokenizer, prompt)[-1][:dimensions], dim=-1)


def test_embeddings_equal_hugging_faces(client, model, tiny_tokenizer, server):
    served = metric(server.url, "vllm:request_success_total", finished_reason="stop")
    response = client.embeddings.create(model="embedder", input=PROMPTS)  # the SDK asks for base64
    assert [item.index for item in response.data] == [0, 1, 2] and response.model == "embedder"
    for prompt, item in zip(PROMPTS, response.data, strict=True):
        torch.testing.assert_close(torch.tensor(item.embedding), expected(model, tiny_tokenizer, prompt),
                                   atol=1e-5, rtol=1e-4)
    tokens = sum(len(tiny_tokenizer(p).input_ids) for p in PROMPTS)
    assert response.usage.prompt_tokens == response.usage.total_tokens == tokens
    floats = client.embeddings.create(model="embedder", input=PROMPTS[1], encoding_format="float")
    assert floats.data[0].embedding == pytest.approx(response.data[1].embedding, abs=1e-7)
    assert metric(server.url, "vllm:request_success_total", finished_reason="stop") == served + 4


def test_dimensions_base64_and_truncation(client, model, tiny_tokenizer):
    cut = client.embeddings.create(model="embedder", input=PROMPTS[0], dimensions=16, encoding_format="float")
    assert len(cut.data[0].embedding) == 16
    torch.testing.assert_close(torch.tensor(cut.data[0].embedding),
                               expected(model, tiny_tokenizer, PROMPTS[0], dimensions=16), atol=1e-5, rtol=1e-4)
    raw = client.embeddings.create(model="embedder", input=[[5, 6, 7]], encoding_format="base64")
    decoded = struct.unpack("<64f", base64.b64decode(raw.data[0].embedding))
    floats = client.embeddings.create(model="embedder", input=[[5, 6, 7]], encoding_format="float")
    assert list(decoded) == pytest.approx(floats.data[0].embedding, abs=0)
    long = list(range(5, 205))
    kept = client.embeddings.create(model="embedder", input=[long], encoding_format="float",
                                    extra_body={"truncate_prompt_tokens": 100})
    last = client.embeddings.create(model="embedder", input=[long[-100:]], encoding_format="float")
    assert kept.data[0].embedding == last.data[0].embedding and kept.usage.prompt_tokens == 100


def test_the_most_inputs_a_request_may_have_fit_the_engines_queue(client):
    response = client.embeddings.create(model="embedder", input=[[5 + i % 40, 6] for i in range(2048)],
                                        encoding_format="float")
    assert len(response.data) == 2048  # the same input at 7 and 2047, in different steps:
    assert response.data[2047].embedding == pytest.approx(response.data[7].embedding, abs=1e-6)


def openai_error(response: httpx2.Response, status: int, param: str | None, says: str) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and says in error["message"], error


def test_errors(server, protocol_server):
    url = f"{server.url}/v1/embeddings"
    openai_error(httpx2.post(url, json={"model": "embedder", "input": [list(range(5, 205))]}), 400, "input",
                 "maximum length")
    openai_error(httpx2.post(url, json={"input": "x", "dimensions": 65}), 400, "dimensions", "65")
    openai_error(httpx2.post(url, json={"input": "x", "dimensions": 0}), 400, "dimensions", "positive")
    openai_error(httpx2.post(url, json={"input": []}), 400, "input", "non-empty")
    openai_error(httpx2.post(url, json={"input": "x", "encoding_format": "int8"}), 400, "encoding_format", "int8")
    openai_error(httpx2.post(url, json={"input": "x", "model": "text-embedding-3-small"}), 404, "model",
                 "text-embedding-3-small")
    openai_error(httpx2.post(f"{server.url}/v1/chat/completions",
                             json={"messages": [{"role": "user", "content": "Hi"}]}), 400, "model", "pooling model")
    openai_error(httpx2.post(f"{protocol_server.url}/v1/embeddings", json={"input": "Hi"}), 400, "model",
                 "generates text")


async def test_a_client_that_hangs_up_frees_the_engine(server):
    # 1024 inputs of 120 tokens: seconds of prefill on two cores, long enough to leave midway.
    body = {"input": [[5 + (i + j) % 50 for j in range(120)] for i in range(1024)]}
    async with httpx2.AsyncClient(timeout=60) as client:

        async def busy() -> bool:
            return await ametric(client, server.url, "vllm:num_requests_running") > 0

        async def idle() -> bool:
            return (await ametric(client, server.url, "vllm:num_requests_running") == 0
                    and await ametric(client, server.url, "vllm:num_requests_waiting") == 0
                    and await ametric(client, server.url, "vllm:kv_cache_usage_perc") == 0)

        embedded = await ametric(client, server.url, "vllm:request_success_total", finished_reason="stop")
        async with trio.open_nursery() as nursery:
            cancel = trio.CancelScope()

            async def request() -> None:
                with cancel:
                    await client.post(f"{server.url}/v1/embeddings", json=body)
                    raise AssertionError("the request should have been cancelled")

            nursery.start_soon(request)
            with trio.fail_after(30):
                await await_condition(busy)
            cancel.cancel()
        with trio.fail_after(20):
            await await_condition(idle)
        done = await ametric(client, server.url, "vllm:request_success_total", finished_reason="stop") - embedded
        assert done < 1024  # the rest were aborted, not computed


def test_an_encoder_serves_embeddings_too(tiny_tokenizer, tmp_path):
    model = build_tiny_encoder(tmp_path / "bert", "bert", tiny_tokenizer)
    with running(triode_serve(model, "--kv-cache-memory", "4MiB", "--dtype", "float32")) as server, \
            openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as client:
        response = client.embeddings.create(model=str(model), input=PROMPTS, dimensions=32)
    assert len(response.data) == len(PROMPTS)
    for prompt, item in zip(PROMPTS, response.data, strict=True):  # CLS, cut, then normalized
        expected = F.normalize(hf_hidden(model, tiny_tokenizer, prompt)[0][:32], dim=-1)
        torch.testing.assert_close(torch.tensor(item.embedding), expected, atol=1e-5, rtol=1e-4)
