"""HTTP tests: the OpenAI-compatible endpoints and their parameters, through the real openai
SDK (sync ``OpenAI`` and ``AsyncOpenAI`` under trio) against one ``triode serve`` process on a
tiny random model (its text is noise; the checks are about shapes, arithmetic and equality)."""

from __future__ import annotations

import json

import httpx2
import openai
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from tests.http_server import metric, running, triode_serve, wait_until

MODEL = "tiny"


@pytest.fixture(scope="module")
def server(tiny_model_factory):
    model = tiny_model_factory("llama")
    flags = ["--served-model-name", MODEL, "--kv-cache-memory", "64MiB", "--trust-request-chat-template",
             "--server-dev-mode"]
    with running(triode_serve(model, *flags)) as s:
        yield s


@pytest.fixture(scope="module")
def url(server) -> str:
    return server.url


@pytest.fixture
def client(url):
    with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as c:
        yield c


def tokenize(url: str, text: str) -> list[int]:
    return httpx2.post(f"{url}/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]


def same_counts(a, b) -> bool:
    """Token counts equal (cached_tokens may differ: the second request hits the prefix cache)."""
    return (a.prompt_tokens, a.completion_tokens, a.total_tokens) == \
        (b.prompt_tokens, b.completion_tokens, b.total_tokens)


def greedy(**extra):
    return dict(temperature=0.0, **extra)


def collect_completion_stream(stream) -> tuple[dict[int, str], dict[int, str], list]:
    texts: dict[int, str] = {}
    finishes: dict[int, list[str]] = {}
    chunks = list(stream)
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.finish_reason is not None:
                finishes.setdefault(choice.index, []).append(choice.finish_reason)
    assert all(len(f) == 1 for f in finishes.values()), finishes  # exactly one finish per choice
    return texts, {i: f[0] for i, f in finishes.items()}, chunks


def collect_chat_stream(stream) -> tuple[dict[int, str], dict[int, str], list]:
    texts: dict[int, str] = {}
    finishes: dict[int, list[str]] = {}
    roles: dict[int, int] = {}
    chunks = list(stream)
    for chunk in chunks:
        for choice in chunk.choices:
            if choice.delta.role is not None:
                roles[choice.index] = roles.get(choice.index, 0) + 1
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason is not None:
                finishes.setdefault(choice.index, []).append(choice.finish_reason)
    assert all(len(f) == 1 for f in finishes.values()), finishes
    assert set(roles) == set(texts) and set(roles.values()) == {1}, roles  # one role per choice
    return texts, {i: f[0] for i, f in finishes.items()}, chunks


def test_models_health_and_version(client, url):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    card = models.data[0]
    assert card.owned_by == "triode"
    assert card.model_extra["max_model_len"] == 512 and card.model_extra["root"]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    assert httpx2.get(f"{url}/health").status_code == 200
    assert httpx2.get(f"{url}/version").json()["version"]


def test_completion_usage_arithmetic(client, url):
    prompt = "The quick brown fox"
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=7, extra_body={"ignore_eos": True},
                                    **greedy())
    assert out.object == "text_completion" and out.model == MODEL
    [choice] = out.choices
    assert choice.finish_reason == "length"
    prompt_tokens = httpx2.post(f"{url}/tokenize", json={"prompt": prompt}).json()["count"]
    assert out.usage.prompt_tokens == prompt_tokens
    assert out.usage.completion_tokens == 7
    assert out.usage.total_tokens == prompt_tokens + 7


@pytest.mark.parametrize("n", [1, 3])
def test_completion_stream_equals_non_stream(client, n):
    params = dict(model=MODEL, prompt="Paris is the capital", max_tokens=12, n=n, seed=7,
                  temperature=0.0 if n == 1 else 0.9)
    whole = client.completions.create(**params)
    texts, finishes, chunks = collect_completion_stream(client.completions.create(
        **params, stream=True, stream_options={"include_usage": True}))
    assert sorted(texts) == list(range(n)) == sorted(finishes)
    assert [texts[c.index] for c in whole.choices] == [c.text for c in whole.choices]
    assert {c.index: c.finish_reason for c in whole.choices} == finishes
    usage = chunks[-1]
    assert usage.choices == [] and same_counts(usage.usage, whole.usage)
    assert all(c.usage is None for c in chunks[:-1])
    if n == 3:
        assert len({c.text for c in whole.choices}) > 1  # sampled, not three copies


@pytest.mark.parametrize("n", [1, 3])
def test_chat_stream_equals_non_stream(client, n):
    params = dict(model=MODEL, messages=[
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hello there"},
        {"role": "assistant", "content": "Hi."},
        {"role": "user", "content": [{"type": "text", "text": "Name a city."}]},
    ], max_completion_tokens=10, n=n, seed=3, temperature=0.0 if n == 1 else 1.0)
    whole = client.chat.completions.create(**params)
    assert whole.object == "chat.completion"
    assert all(c.message.role == "assistant" for c in whole.choices)
    texts, finishes, chunks = collect_chat_stream(client.chat.completions.create(
        **params, stream=True, stream_options={"include_usage": True}))
    assert [texts[c.index] for c in whole.choices] == [c.message.content for c in whole.choices]
    assert {c.index: c.finish_reason for c in whole.choices} == finishes
    assert chunks[-1].choices == [] and same_counts(chunks[-1].usage, whole.usage)
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens
    assert whole.usage.completion_tokens <= 10 * n


def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(client):
    """vLLM's stream_options.continuous_usage_stats: each chunk's usage counts the tokens sent
    so far (it was accepted and ignored), and the last chunk's is the whole request's."""
    params = dict(model=MODEL, prompt="Paris is the capital", max_tokens=6, **greedy())
    whole = client.completions.create(**params)
    _, _, chunks = collect_completion_stream(client.completions.create(
        **params, stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True}))
    assert len(chunks) >= 3 and all(c.usage is not None for c in chunks)
    completion_tokens = [c.usage.completion_tokens for c in chunks]
    assert completion_tokens == sorted(completion_tokens) and completion_tokens[0] >= 1
    assert all(c.usage.prompt_tokens == whole.usage.prompt_tokens for c in chunks)
    assert chunks[-1].choices == [] and same_counts(chunks[-1].usage, whole.usage)


def test_prompt_forms_and_choice_indices(client, url):
    ids = tokenize(url, "structured concurrency")
    by_text = client.completions.create(model=MODEL, prompt="structured concurrency", max_tokens=5, **greedy())
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=5, **greedy())
    assert by_ids.choices[0].text == by_text.choices[0].text
    batch = client.completions.create(model=MODEL, prompt=["structured concurrency", "a paged cache"],
                                      max_tokens=5, n=2, **greedy())
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert batch.choices[0].text == batch.choices[1].text == by_text.choices[0].text
    single = client.completions.create(model=MODEL, prompt="a paged cache", max_tokens=5, **greedy())
    assert batch.choices[2].text == single.choices[0].text
    assert batch.usage.prompt_tokens == by_text.usage.prompt_tokens + single.usage.prompt_tokens
    assert batch.usage.completion_tokens == 2 * (by_text.usage.completion_tokens
                                                 + single.usage.completion_tokens)
    lists = client.completions.create(model=MODEL, prompt=[ids, tokenize(url, "a paged cache")],
                                      max_tokens=5, **greedy())
    assert [c.text for c in lists.choices] == [by_text.choices[0].text, single.choices[0].text]
    texts, _, _ = collect_completion_stream(client.completions.create(
        model=MODEL, prompt=["structured concurrency", "a paged cache"], max_tokens=5, n=2, stream=True,
        **greedy()))
    assert [texts[i] for i in range(4)] == [c.text for c in batch.choices]


def test_echo_and_completion_logprobs(client):
    prompt = "The quick brown fox"
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, logprobs=3, echo=True,
                                    extra_body={"ignore_eos": True}, **greedy())
    choice = out.choices[0]
    assert choice.text.startswith(prompt)
    lp = choice.logprobs
    total = out.usage.prompt_tokens + out.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == total
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(a <= b for a, b in zip(lp.text_offset, lp.text_offset[1:], strict=False))
    for chosen, top in zip(lp.token_logprobs[1:], lp.top_logprobs[1:], strict=True):
        assert chosen <= 0 and 1 <= len(top) <= 4
    generated = lp.token_logprobs[out.usage.prompt_tokens:]
    for chosen, top in zip(generated, lp.top_logprobs[out.usage.prompt_tokens:], strict=True):
        assert chosen == pytest.approx(max(top.values()))  # greedy picks the top token
    streamed = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, logprobs=3,
                                              stream=True, extra_body={"ignore_eos": True}, **greedy()))
    tokens = [t for chunk in streamed for c in chunk.choices if c.logprobs for t in c.logprobs.token_logprobs]
    assert tokens == pytest.approx(generated)
    echoed, _, _ = collect_completion_stream(client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=6, echo=True, stream=True, extra_body={"ignore_eos": True},
        **greedy()))
    assert echoed[0] == choice.text


def test_echo_with_max_tokens_zero_scores_the_prompt(client, url):
    """lm-eval's loglikelihood requests: echo, max_tokens 0 and logprobs return the prompt and
    its logprobs, nothing generated, as vLLM serves them."""
    prompt = ["The quick brown fox", "jumps over"]
    generated = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, logprobs=1, echo=True,
                                          extra_body={"ignore_eos": True}, **greedy())
    scored = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, logprobs=1, echo=True,
                                       **greedy())
    assert len(scored.choices) == len(generated.choices) == 2
    assert scored.usage.completion_tokens == 0
    assert scored.usage.prompt_tokens == generated.usage.prompt_tokens
    for text, score, full in zip(prompt, scored.choices, generated.choices, strict=True):
        count = len(tokenize(url, text))
        assert score.text == text and score.finish_reason == "length"
        assert len(score.logprobs.tokens) == len(score.logprobs.token_logprobs) == count
        assert score.logprobs.tokens == full.logprobs.tokens[:count]
        assert score.logprobs.token_logprobs == pytest.approx(full.logprobs.token_logprobs[:count])
        assert score.logprobs.token_logprobs[0] is None
    streamed, finishes, chunks = collect_completion_stream(client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=0, logprobs=1, echo=True, stream=True,
        stream_options={"include_usage": True}, **greedy()))
    assert streamed == {0: prompt[0], 1: prompt[1]} and finishes == {0: "length", 1: "length"}
    assert chunks[-1].usage.completion_tokens == 0
    for body, field in [({"max_tokens": 0}, "max_tokens"),
                        ({"max_tokens": 0, "echo": True, "min_tokens": 1}, "min_tokens")]:
        reply = httpx2.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "Hi", **body})
        assert reply.status_code == 400 and reply.json()["error"]["param"] == field, reply.text


def test_chat_response_shape_follows_the_openai_schema(url):
    """``message.refusal`` is required (nullable); ``system_fingerprint`` may be omitted but
    is never null."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    out = httpx2.post(f"{url}/v1/chat/completions", json=body).json()
    assert out["choices"][0]["message"] == {"role": "assistant", "content": out["choices"][0]["message"]["content"],
                                            "refusal": None}
    assert out.get("system_fingerprint", "") is not None
    completion = httpx2.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2}).json()
    assert completion.get("system_fingerprint", "") is not None



def test_a_trusted_request_chat_template(url):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    templated = httpx2.post(f"{url}/v1/chat/completions", json={
        **body, "chat_template": "{{ messages[0]['content'] }} {{ who }}", "chat_template_kwargs": {"who": "says"},
    }).json()
    assert templated["usage"]["prompt_tokens"] == len(tokenize(url, "Hi says"))
    broken = httpx2.post(f"{url}/v1/chat/completions", json={**body, "chat_template": "{% for %}"})
    assert broken.status_code == 400 and broken.json()["error"]["param"] == "chat_template"
    raised = httpx2.post(f"{url}/v1/chat/completions", json={
        **body, "chat_template": "{{ raise_exception('no system role') }}"})
    assert raised.status_code == 400 and "no system role" in raised.json()["error"]["message"]


def test_chat_logprobs(client):
    params = dict(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=6, logprobs=True,
                  top_logprobs=4, extra_body={"ignore_eos": True}, **greedy())
    out = client.chat.completions.create(**params)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens == 6
    for entry in content:
        assert len(entry.top_logprobs) == 4 and isinstance(entry.bytes, list)
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)  # greedy
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs),
                                                                  reverse=True)
    streamed = [e for chunk in client.chat.completions.create(**params, stream=True)
                for c in chunk.choices if c.logprobs for e in c.logprobs.content]
    assert [(e.token, e.bytes) for e in streamed] == [(e.token, e.bytes) for e in content]
    plain = client.chat.completions.create(**{**params, "logprobs": False, "top_logprobs": None})
    assert plain.choices[0].logprobs is None


def _clean_window(text: str, start: int, width: int = 3) -> str:
    for i in range(start, len(text) - width):
        window = text[i:i + width]
        if "\ufffd" not in window and window.strip() and text.find(window) == i:
            return window
    pytest.skip("the random model's text has no usable stop string")


def test_stop_strings(client):
    params = dict(model=MODEL, prompt="Berlin is the capital of", max_tokens=40,
                  extra_body={"ignore_eos": True}, **greedy())
    text = client.completions.create(**params).choices[0].text
    stop = _clean_window(text, 8)
    cut = text.index(stop)
    out = client.completions.create(**{**params, "stop": [stop, "never-there"]}).choices[0]
    assert (out.text, out.finish_reason, out.model_extra["stop_reason"]) == (text[:cut], "stop", stop)
    kept = client.completions.create(**{**params, "stop": stop, "extra_body": {
        "ignore_eos": True, "include_stop_str_in_output": True}}).choices[0]
    assert kept.text == text[:cut + len(stop)]
    texts, finishes, _ = collect_completion_stream(client.completions.create(**{**params, "stop": stop},
                                                                             stream=True))
    assert (texts[0], finishes[0]) == (text[:cut], "stop")


def test_logit_bias_stop_token_ids_min_tokens_ignore_eos(client, url):
    forced = tokenize(url, "The quick brown fox")[1]
    piece = httpx2.post(f"{url}/detokenize", json={"tokens": [forced]}).json()["prompt"]
    biased = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, logit_bias={str(forced): 100},
                                       extra_body={"ignore_eos": True}, **greedy())
    assert biased.choices[0].text == piece * 4
    stopped = client.completions.create(model=MODEL, prompt="Hello", max_tokens=8,
                                        logit_bias={str(forced): 100},
                                        extra_body={"stop_token_ids": [forced]}, **greedy()).choices[0]
    assert stopped.finish_reason == "stop" and stopped.model_extra["stop_reason"] == forced
    eos = 0  # <|endoftext|>
    quick = client.completions.create(model=MODEL, prompt="Hello", max_tokens=8, logit_bias={str(eos): 100},
                                      **greedy())
    assert quick.choices[0].finish_reason == "stop" and quick.usage.completion_tokens == 1
    held = client.completions.create(model=MODEL, prompt="Hello", max_tokens=8, logit_bias={str(eos): 100},
                                     extra_body={"min_tokens": 5}, **greedy())
    assert held.usage.completion_tokens >= 5
    ignored = client.completions.create(model=MODEL, prompt="Hello", max_tokens=8, logit_bias={str(eos): 100},
                                        extra_body={"ignore_eos": True}, **greedy())
    assert (ignored.usage.completion_tokens, ignored.choices[0].finish_reason) == (8, "length")


def test_skip_special_tokens(client):
    im_end = 2
    params = dict(model=MODEL, prompt="Hello", max_tokens=3, logit_bias={str(im_end): 100}, **greedy())
    hidden = client.completions.create(**params, extra_body={"ignore_eos": True})
    shown = client.completions.create(**params, extra_body={"ignore_eos": True, "skip_special_tokens": False})
    assert hidden.choices[0].text == ""
    assert shown.choices[0].text == "<|im_end|>" * 3


def test_sampling_parameters_and_seed(client):
    params = dict(model=MODEL, prompt="Numbers like", max_tokens=10, temperature=0.8, top_p=0.9, seed=1234,
                  presence_penalty=0.5, frequency_penalty=0.3, user="tester",
                  extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.2, "unknown_field": 1})
    first = client.completions.create(**params)
    again = client.completions.create(**params)
    assert first.choices[0].text == again.choices[0].text
    other = client.completions.create(**{**params, "seed": 99})
    assert other.usage.completion_tokens == 10
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=5, temperature=0.7, top_p=0.5, seed=5, stop=["\n"],
                                          presence_penalty=0.1, frequency_penalty=0.1, user="u",
                                          extra_body={"top_k": 5, "min_p": 0.1, "repetition_penalty": 1.1})
    assert chat.choices[0].finish_reason in ("stop", "length")


def test_request_id_is_honoured_and_echoed(client):
    raw = client.completions.with_raw_response.create(model=MODEL, prompt="Hi", max_tokens=2,
                                                      extra_headers={"X-Request-Id": "req-42"})
    assert raw.headers["x-request-id"] == "req-42"
    assert raw.parse().id == "cmpl-req-42"
    raw = client.chat.completions.with_raw_response.create(model=MODEL, max_tokens=2,
                                                           messages=[{"role": "user", "content": "Hi"}])
    assert raw.parse().id == "chatcmpl-" + raw.headers["x-request-id"]


def test_model_may_be_omitted(url):
    out = httpx2.post(f"{url}/v1/chat/completions",
                      json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}).json()
    assert out["model"] == MODEL and out["choices"][0]["message"]["role"] == "assistant"
    out = httpx2.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}).json()
    assert out["usage"]["completion_tokens"] <= 2


def test_tokenize_and_detokenize(client, url):
    text = "héllo wörld 🙂"
    tokens = httpx2.post(f"{url}/tokenize", json={"model": MODEL, "prompt": text, "return_token_strs": True}).json()
    assert tokens["count"] == len(tokens["tokens"]) == len(tokens["token_strs"])
    assert tokens["max_model_len"] == 512
    back = httpx2.post(f"{url}/detokenize", json={"model": MODEL, "tokens": tokens["tokens"]}).json()
    assert back["prompt"] == text
    messages = [{"role": "user", "content": "Hello"}]
    chat_tokens = httpx2.post(f"{url}/tokenize", json={"messages": messages}).json()
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    assert chat_tokens["count"] == chat.usage.prompt_tokens
    rendered = httpx2.post(f"{url}/detokenize", json={"tokens": chat_tokens["tokens"]}).json()["prompt"]
    assert rendered.endswith("<|im_start|>assistant\n")


# vLLM's metrics as its documentation (docs/design/metrics.md, docs/usage/metrics.md) lists
# them: the name as exposed, the type, the labels besides model_name and engine.
VLLM_METRICS = {
    "vllm:num_requests_running": ("gauge", ()),
    "vllm:num_requests_waiting": ("gauge", ()),
    "vllm:kv_cache_usage_perc": ("gauge", ()),
    "vllm:prefix_cache_queries": ("counter", ()),
    "vllm:prefix_cache_hits": ("counter", ()),
    "vllm:prompt_tokens": ("counter", ()),
    "vllm:generation_tokens": ("counter", ()),
    "vllm:num_preemptions": ("counter", ()),
    "vllm:request_success": ("counter", ("finished_reason",)),
    "vllm:time_to_first_token_seconds": ("histogram", ()),
    "vllm:inter_token_latency_seconds": ("histogram", ()),
    "vllm:request_time_per_output_token_seconds": ("histogram", ()),
    "vllm:e2e_request_latency_seconds": ("histogram", ()),
    "vllm:request_queue_time_seconds": ("histogram", ()),
    "vllm:request_prefill_time_seconds": ("histogram", ()),
    "vllm:request_decode_time_seconds": ("histogram", ()),
    "vllm:request_inference_time_seconds": ("histogram", ()),
    "vllm:request_prompt_tokens": ("histogram", ()),
    "vllm:request_generation_tokens": ("histogram", ()),
    "vllm:request_params_max_tokens": ("histogram", ()),
    "vllm:request_params_n": ("histogram", ()),
    "vllm:iteration_tokens_total": ("histogram", ()),
}
VLLM_TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                     20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
VLLM_ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                    40.0, 80.0]
VLLM_REQUEST_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                        240.0, 480.0, 960.0, 1920.0, 7680.0]


def _families(url: str) -> dict:
    text = httpx2.get(f"{url}/metrics").text
    return {family.name: family for family in text_string_to_metric_families(text)}


def _buckets(family) -> list[float]:
    return [float(s.labels["le"]) for s in family.samples if s.name.endswith("_bucket") and s.labels["le"] != "+Inf"]


def test_metrics_carry_vllms_names_types_labels_and_buckets(client, url):
    client.completions.create(model=MODEL, prompt="Hi", max_tokens=3, stream=False)
    families = _families(url)
    names = {"vllm:iteration_tokens_total" if n == "vllm:iteration_tokens" else n for n in families}
    assert set(VLLM_METRICS) <= names, set(VLLM_METRICS) - names
    for name, (kind, extra) in VLLM_METRICS.items():
        family = families.get(name) or families[name.removesuffix("_total")]
        assert family.type == kind, name
        assert len(family.samples) >= 1, name
        for sample in family.samples:
            expected = {"model_name", "engine", *extra} | ({"le"} if sample.name.endswith("_bucket") else set())
            assert set(sample.labels) == expected, (name, sample.labels)
            assert sample.labels["model_name"] == MODEL and sample.labels["engine"] == "0"
    assert _buckets(families["vllm:time_to_first_token_seconds"]) == VLLM_TTFT_BUCKETS
    assert _buckets(families["vllm:inter_token_latency_seconds"]) == VLLM_ITL_BUCKETS
    for name in ("e2e_request_latency_seconds", "request_queue_time_seconds", "request_prefill_time_seconds",
                 "request_decode_time_seconds", "request_inference_time_seconds"):
        assert _buckets(families[f"vllm:{name}"]) == VLLM_REQUEST_BUCKETS, name
    assert _buckets(families["vllm:request_params_n"]) == [1, 2, 5, 10, 20]
    # 1, 2, 5, 10, 20, 50, ... up to the model's maximum length.
    max_model_len = httpx2.get(f"{url}/v1/models").json()["data"][0]["max_model_len"]
    expected = sorted(m * 10**k for m in (1, 2, 5) for k in range(8) if m * 10**k <= max_model_len)
    assert len(expected) >= 4
    for name in ("request_prompt_tokens", "request_generation_tokens", "request_params_max_tokens"):
        assert _buckets(families[f"vllm:{name}"]) == expected, name
    reasons = {s.labels["finished_reason"] for s in families["vllm:request_success"].samples}
    assert {"stop", "length", "abort"} <= reasons
    usage = families["vllm:kv_cache_usage_perc"].samples
    assert len(usage) == 1 and 0.0 <= usage[0].value <= 1.0


def test_cache_config_info_names_the_block_size_and_blocks(url):
    family = _families(url)["vllm:cache_config_info"]
    assert family.type == "gauge"
    (sample,) = family.samples
    assert sample.value == 1.0
    assert sample.labels["block_size"] == "16" and int(sample.labels["num_gpu_blocks"]) > 0
    assert sample.labels["engine"] == "0" and sample.labels["enable_prefix_caching"] == "True"


def test_triodes_own_metrics_keep_their_prefix(url):
    text = httpx2.get(f"{url}/metrics").text
    assert f'triode:worker_pid{{engine="0",model_name="{MODEL}",rank="0"}}' in text
    assert f'triode:rank_step_seconds_total{{engine="0",model_name="{MODEL}",rank="0"}}' in text
    assert f'triode:engine_steps_total{{engine="0",model_name="{MODEL}"}}' in text
    assert f'triode:worker_restarts_total{{engine="0",model_name="{MODEL}"}}' in text
    assert "process_resident_memory_bytes " in text
    assert "triode:num_requests_running" not in text  # served once, under vLLM's name


# The openai SDK leaves its SSE byte iterators unexhausted after [DONE] (it stops reading and
# closes the response), and trio warns when it finalizes them: not our code.
@pytest.mark.filterwarnings(r"ignore:Async generator '(openai|httpx2|httpcore2)\.[\w.]+' was garbage collected")
async def test_async_client_under_trio(url):
    messages = [{"role": "user", "content": "Tell me about Paris"}]
    results: dict[int, str] = {}
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as client:
        whole = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12,
                                                     temperature=0)

        async def stream(index: int) -> None:
            text = ""
            async for chunk in await client.chat.completions.create(
                    model=MODEL, messages=messages, max_tokens=12, temperature=0, stream=True):
                for choice in chunk.choices:
                    text += choice.delta.content or ""
            results[index] = text

        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                for index in range(4):
                    nursery.start_soon(stream, index)
    assert list(results.values()) == [whole.choices[0].message.content] * 4


async def test_an_error_after_the_stream_started_is_an_sse_error_event():
    """In-process: the status line is gone once a stream started, so a later failure (here the
    engine dying) becomes an ``event: error`` with OpenAI's error object, then ``[DONE]``."""
    from triode.engine.errors import EngineDeadError
    from triode.frontend.openai import sse

    async def chunks():
        yield {"choices": [{"index": 0, "text": "Hel"}]}
        raise EngineDeadError("the workers failed 3 times in 60 s")

    events = [event async for event in sse.event_stream(chunks())]
    assert events[0] == b'data: {"choices":[{"index":0,"text":"Hel"}]}\n\n'
    assert events[1].startswith(b"event: error\ndata: ")
    error = json.loads(events[1].split(b"data: ", 1)[1])["error"]
    assert error["code"] == "engine_dead" and "workers failed" in error["message"]
    assert events[2:] == [sse.DONE]


def test_reset_prefix_cache_in_development_mode(client, url):
    prompt = "A paged key-value cache keeps attention keys in blocks of sixteen tokens, " * 3

    def hits_after_a_request() -> float:
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, **greedy())
        return metric(url, "vllm:prefix_cache_hits_total")

    first = hits_after_a_request()
    assert hits_after_a_request() > first  # the same prompt again: its blocks are hit
    assert httpx2.post(f"{url}/reset_prefix_cache", timeout=30).status_code == 200
    before = metric(url, "vllm:prefix_cache_hits_total")
    assert hits_after_a_request() == before  # forgotten: computed again
    with client.completions.create(model=MODEL, prompt="Count:", max_tokens=200, stream=True,
                                   extra_body={"ignore_eos": True}) as stream:
        next(iter(stream))  # running, holding blocks
        busy = httpx2.post(f"{url}/reset_prefix_cache", timeout=30)
        assert busy.status_code == 409
        assert busy.json()["error"]["code"] == "requests_running"
    wait_until(lambda: httpx2.post(f"{url}/reset_prefix_cache", timeout=30).status_code == 200,
               what="the reset once the aborted stream's blocks are free")
    refused = httpx2.post(f"{url}/reset_prefix_cache?reset_running_requests=true", timeout=30)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "reset_running_requests"
    garbled = httpx2.post(f"{url}/reset_prefix_cache?reset_external=maybe", timeout=30)
    assert garbled.status_code == 400 and "true or false" in garbled.json()["error"]["message"]
    assert httpx2.post(f"{url}/reset_prefix_cache?reset_external=false", timeout=30).status_code == 200


def test_reset_prefix_cache_is_not_served_outside_development_mode():
    from triode.frontend.server.factory import create_app
    from triode.frontend.server.settings import ServerSettings

    async def post() -> int:
        app = create_app(settings=ServerSettings.from_env({}))
        return (await app.test_client().post("/reset_prefix_cache")).status_code

    assert trio.run(post) == 404


def test_app_is_importable_without_starting_anything():
    from triode import frontend
    from triode.frontend.server.factory import create_app

    assert callable(frontend.app)  # hypercorn's triode.frontend:app, built on first call
    app = create_app()
    assert app.config["RESPONSE_TIMEOUT"] is None  # quart's 60 s default would cut long streams
    assert app.extensions["triode"].state == "stopped"


def test_health_and_admission_name_the_engine_state():
    """In-process: /health and new requests say loading, dead or draining as a 503."""
    from triode.engine.config import EngineArgs
    from triode.engine.errors import EngineDeadError
    from triode.frontend.openai.errors import APIError
    from triode.frontend.server.lifecycle import EngineHost

    class DeadEngine:
        def check_health(self) -> None:
            raise EngineDeadError("the workers failed 3 times in 60 s")

    host = EngineHost(EngineArgs())
    for state, llm, code in (("loading", None, "loading"), ("ready", DeadEngine(), "engine_dead"),
                             ("draining", DeadEngine(), "draining")):
        host.state, host.llm = state, llm
        with pytest.raises(APIError) as raised:
            host.require_ready()
        assert (raised.value.status, raised.value.code) == (503, code)
    assert host.health == "draining"
