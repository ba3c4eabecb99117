"""HTTP tests of LoRA adapters: the openai SDK against ``triode serve --enable-lora
--lora-modules`` on a tiny random Llama with PEFT adapters. A request's ``model`` selects its
adapter (greedy text equal to ``PeftModel``'s); ``/v1/models`` lists adapters with their
parent; adapters loaded, used, unloaded and used after unloading (404) at run time; bad
adapters refused with 400 naming them while other requests go on; a prompt shared by two
adapters never hits the other's prefix cache; structured outputs with an adapter; and
``vllm:lora_requests_info``. Without ``--allow-runtime-lora-updating`` the endpoints do not
exist."""

from __future__ import annotations

import json

import httpx2
import openai
import pytest

from tests.hf_compare import hf_greedy
from tests.http_server import metric, running, triode_serve
from tests.lora_adapters import build_adapter

PROMPT = "Paris is the capital of"
SHARED = ("A paged key-value cache stores attention keys in fixed-size blocks of tokens, and "
          "structured concurrency keeps every task inside a nursery. ")
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def base(tiny_model_factory):
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def adapters(base, tmp_path_factory):
    root = tmp_path_factory.mktemp("http-lora")
    return {name: build_adapter(base, root / name, rank=rank, seed=seed, scale=3.0)
            for name, rank, seed in (("sql", 8, 11), ("poet", 16, 12), ("late", 8, 13), ("wide", 32, 14))}


@pytest.fixture(scope="module")
def server(base, adapters):
    flags = ["--served-model-name", "tiny", "--max-model-len", "256", "--kv-cache-memory", "16MiB",
             "--enable-lora", "--max-loras", "2", "--max-lora-rank", "16",
             "--lora-modules", f"sql={adapters['sql']}", json.dumps({"name": "poet", "path": str(adapters["poet"])}),
             "--allow-runtime-lora-updating"]
    with running(triode_serve(base, *flags)) as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                       _strict_response_validation=True) as client:
        yield client


def _greedy(client, model: str, prompt: str = PROMPT, max_tokens: int = MAX_TOKENS):
    return client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0.0)


def test_models_lists_the_adapters_with_their_parent(client, adapters):
    models = {card.id: card for card in client.models.list().data}
    assert sorted(models) == ["poet", "sql", "tiny"]
    assert models["tiny"].parent is None
    for name in ("sql", "poet"):
        assert models[name].parent == "tiny"
        assert models[name].root == str(adapters[name])
    assert client.models.retrieve("sql").id == "sql"


def test_the_model_field_selects_the_adapter_as_peft_runs_it(client, base, adapters, tiny_tokenizer):
    prompt_ids = tiny_tokenizer.encode(PROMPT)
    texts = {}
    for model in ("tiny", "sql", "poet"):
        completion = _greedy(client, model)
        assert completion.model == model
        texts[model] = completion.choices[0].text
    assert len(set(texts.values())) == 3
    for name in ("sql", "poet"):
        [(tokens, _)] = hf_greedy(base, [prompt_ids], MAX_TOKENS, adapter=adapters[name])
        assert texts[name] == tiny_tokenizer.decode(tokens)


def test_load_use_unload_and_use_after_unload(client, server, adapters):
    with pytest.raises(openai.NotFoundError, match="'late' does not exist"):
        _greedy(client, "late")
    response = httpx2.post(f"{server.url}/v1/load_lora_adapter",
                           json={"lora_name": "late", "lora_path": str(adapters["late"])}, timeout=30)
    assert response.status_code == 200, response.text
    assert response.text == "Success: LoRA adapter 'late' added successfully."
    assert "late" in {card.id for card in client.models.list().data}
    text = _greedy(client, "late").choices[0].text
    again = httpx2.post(f"{server.url}/v1/load_lora_adapter",
                        json={"lora_name": "late", "lora_path": str(adapters["late"])}, timeout=30)
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
    response = httpx2.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": "late"}, timeout=30)
    assert response.status_code == 200, response.text
    with pytest.raises(openai.NotFoundError) as caught:
        _greedy(client, "late")
    assert caught.value.body["param"] == "model" and "'tiny', 'sql', 'poet'" in caught.value.body["message"]
    response = httpx2.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": "late"}, timeout=30)
    assert response.status_code == 404 and "cannot be found" in response.json()["error"]["message"]
    # loaded again (a new id): the same adapter gives the same text
    response = httpx2.post(f"{server.url}/v1/load_lora_adapter",
                           json={"lora_name": "late", "lora_path": str(adapters["late"])}, timeout=30)
    assert response.status_code == 200
    assert _greedy(client, "late").choices[0].text == text
    httpx2.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": "late"}, timeout=30)


@pytest.mark.parametrize("body,status,reason", [
    ({"lora_name": "wide", "lora_path": "WIDE"}, 400, "its rank 32 exceeds --max-lora-rank 16"),
    ({"lora_name": "gone", "lora_path": "/nonexistent/adapter"}, 400, "is not a directory"),
    ({"lora_name": "tiny", "lora_path": "WIDE"}, 400, "base model's name"),
    ({"lora_path": "WIDE"}, 400, "lora_name: is required"),
    ({"lora_name": "x"}, 400, "lora_path: is required"),
])
def test_bad_loads_are_400s_naming_the_reason(client, server, adapters, body, status, reason):
    body = {key: str(adapters["wide"]) if value == "WIDE" else value for key, value in body.items()}
    response = httpx2.post(f"{server.url}/v1/load_lora_adapter", json=body, timeout=30)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert reason in error["message"] and error["type"] == "invalid_request_error"
    assert "wide" not in {card.id for card in client.models.list().data}
    assert _greedy(client, "sql").choices[0].text  # nothing else was disturbed


def test_a_prefix_shared_by_two_adapters_is_not_reused_across_them(client, server):
    prompt = SHARED + "Paris"
    hits = metric(server.url, "vllm:prefix_cache_hits_total")
    first = client.completions.create(model="sql", prompt=prompt, max_tokens=2, temperature=0.0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    other = client.completions.create(model="poet", prompt=prompt, max_tokens=2, temperature=0.0)
    assert other.usage.prompt_tokens_details.cached_tokens == 0
    assert metric(server.url, "vllm:prefix_cache_hits_total") == hits
    again = client.completions.create(model="sql", prompt=prompt, max_tokens=2, temperature=0.0)
    assert again.usage.prompt_tokens_details.cached_tokens > 0


def test_structured_outputs_with_an_adapter(client):
    for model in ("poet", "sql"):
        completion = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Which city?"}], max_tokens=20, temperature=0.0,
            extra_body={"structured_outputs": {"choice": ["Paris", "Berlin", "Lisbon"]}})
        assert completion.model == model
        assert completion.choices[0].message.content in ("Paris", "Berlin", "Lisbon")
        assert completion.choices[0].finish_reason == "stop"


def test_lora_requests_info(server):
    assert metric(server.url, "vllm:lora_requests_info", max_lora="2", running_lora_adapters="",
                  waiting_lora_adapters="") > 1.7e9  # the time of the reading


def test_without_runtime_updating_the_endpoints_do_not_exist(protocol_server):
    response = httpx2.post(f"{protocol_server.url}/v1/load_lora_adapter",
                           json={"lora_name": "a", "lora_path": "/x"}, timeout=30)
    assert response.status_code == 404
