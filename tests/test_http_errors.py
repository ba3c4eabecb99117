"""HTTP tests: authentication and bad input. Every bad request gets a 4xx in OpenAI's error
shape naming the problem (never a 500, never a hang), while a valid stream runs alongside
undisturbed. One ``triode serve`` with two API keys and a 64 KiB body limit."""

from __future__ import annotations

import asyncio
import json
import socket

import anthropic
import httpx2
import openai
import pytest
import trio

from tests.http_server import running, triode_serve

KEYS = ("key-one", "key-two")
MODEL = "tiny"
AUTH = {"Authorization": f"Bearer {KEYS[0]}"}


@pytest.fixture(scope="module")
def url(tiny_model_factory):
    model = tiny_model_factory("llama")
    flags = ["--served-model-name", MODEL, "--kv-cache-memory", "64MiB", "--max-body-size", "64KiB", "--api-key", KEYS[0],
             "--api-key", KEYS[1]]
    with running(triode_serve(model, *flags)) as server:
        yield server.url


def assert_error(response: httpx2.Response, status: int, *, param: str | None = None,
                 code: str | None = None, says: str | None = None) -> dict:
    assert response.status_code == status, (response.status_code, response.text)
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    error = body["error"]
    assert error["message"] and error["type"]
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    if says is not None:
        assert says in error["message"], error
    return error


def test_api_keys(url):
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    assert_error(httpx2.post(f"{url}/v1/chat/completions", json=chat), 401, code="invalid_api_key")
    assert_error(httpx2.post(f"{url}/v1/chat/completions", json=chat,
                             headers={"Authorization": "Bearer key-three"}), 401)
    assert_error(httpx2.post(f"{url}/v1/chat/completions", json=chat,
                             headers={"Authorization": f"Basic {KEYS[0]}"}), 401)
    assert_error(httpx2.get(f"{url}/v1/models"), 401)
    assert_error(httpx2.get(f"{url}/v1/no-such-route"), 401)  # auth comes before routing
    for key in KEYS:
        with openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0) as client:
            model = client.models.list().data[0].id
            assert client.chat.completions.create(model=model, **chat).choices
    with openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0) as client:
        with pytest.raises(openai.AuthenticationError):
            client.models.list()
    assert httpx2.get(f"{url}/health").status_code == 200
    assert httpx2.get(f"{url}/metrics").status_code == 200


def test_anthropic_clients_send_their_key_as_x_api_key(url):
    for key in KEYS:
        with anthropic.Anthropic(base_url=url, api_key=key, max_retries=0) as client:
            assert client.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": "Hi"}]).input_tokens
    with anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0) as client:
        with pytest.raises(anthropic.AuthenticationError) as caught:
            client.messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "Hi"}])
    assert caught.value.body == {"type": "error", "error": {"type": "authentication_error",
                                                             "message": caught.value.body["error"]["message"]}}
    assert httpx2.get(f"{url}/v1/models", headers={"x-api-key": KEYS[1]}).status_code == 200


def _post(url: str, path: str, body, **kwargs) -> httpx2.Response:
    if not isinstance(body, bytes):
        body = json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **AUTH, **kwargs.pop("headers", {})}
    return httpx2.post(f"{url}{path}", content=body, headers=headers, timeout=30, **kwargs)


CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "user", "content": "Hi"}]
DEEP = json.loads('{"type":"object","properties":{"a":' * 100 + "{}" + "}}" * 100)  # past json_nesting.MAX_DEPTH

BAD_REQUESTS = [
    # (path, body, status, param, code)
    (COMPLETIONS, b'{"prompt": "Hi", ', 400, None, "invalid_json"),
    (COMPLETIONS, b"", 400, None, "invalid_json"),
    (COMPLETIONS, b'["prompt"]', 400, None, "invalid_json"),
    (COMPLETIONS, b'{"prompt": "Hi", "temperature": NaN}', 400, None, "invalid_json"),
    (COMPLETIONS, b'{"prompt": "Hi", "max_tokens": 1e999}', 400, "max_tokens", None),
    (COMPLETIONS, b'{"prompt": "\xff\xfe caf\xe9"}', 400, None, "invalid_utf8"),
    (COMPLETIONS, b"[" * 100_000 + b"]" * 100_000, 413, None, "request_too_large"),
    (COMPLETIONS, b'{"a":' * 5000 + b"1" + b"}" * 5000, 400, None, "invalid_json"),
    (COMPLETIONS, {"prompt": "x" * 70_000}, 413, None, "request_too_large"),
    (COMPLETIONS, {}, 400, "prompt", None),
    (COMPLETIONS, {"prompt": ""}, 400, "prompt", None),
    (COMPLETIONS, {"prompt": []}, 400, "prompt", None),
    (COMPLETIONS, {"prompt": [1, "two"]}, 400, "prompt", None),
    (COMPLETIONS, {"prompt": [[1, 2], []]}, 400, "prompt", None),
    (COMPLETIONS, {"prompt": [10**6]}, 400, "prompt", None),
    (COMPLETIONS, {"prompt": "Hi", "max_tokens": "ten"}, 400, "max_tokens", None),
    (COMPLETIONS, {"prompt": "Hi", "max_tokens": 0}, 400, "max_tokens", None),
    (COMPLETIONS, {"prompt": "Hi", "max_tokens": True}, 400, "max_tokens", None),
    (COMPLETIONS, {"prompt": "Hi", "temperature": -1}, 400, "temperature", None),
    (COMPLETIONS, {"prompt": "Hi", "temperature": "hot"}, 400, "temperature", None),
    (COMPLETIONS, {"prompt": "Hi", "top_p": 1.5}, 400, "top_p", None),
    (COMPLETIONS, {"prompt": "Hi", "top_k": -2}, 400, "top_k", None),
    (COMPLETIONS, {"prompt": "Hi", "min_p": 2}, 400, "min_p", None),
    (COMPLETIONS, {"prompt": "Hi", "n": 0}, 400, "n", None),
    (COMPLETIONS, {"prompt": "Hi", "n": 10**9}, 400, "n", None),
    (COMPLETIONS, {"prompt": ["Hi"] * 20, "n": 100}, 400, "n", None),
    (COMPLETIONS, {"prompt": ["Hi"] * 300}, 400, "prompt", None),
    (COMPLETIONS, {"prompt": "Hi", "presence_penalty": 3}, 400, "presence_penalty", None),
    (COMPLETIONS, {"prompt": "Hi", "frequency_penalty": -3}, 400, "frequency_penalty", None),
    (COMPLETIONS, {"prompt": "Hi", "repetition_penalty": 0}, 400, "repetition_penalty", None),
    (COMPLETIONS, {"prompt": "Hi", "seed": 2**70}, 400, "seed", None),
    (COMPLETIONS, {"prompt": "Hi", "stop": [1, 2]}, 400, "stop", None),
    (COMPLETIONS, {"prompt": "Hi", "stop": [""]}, 400, "stop", None),
    (COMPLETIONS, {"prompt": "Hi", "stop_token_ids": [-1]}, 400, "stop_token_ids", None),
    (COMPLETIONS, {"prompt": "Hi", "stop_token_ids": [10**6]}, 400, "stop_token_ids", None),
    (COMPLETIONS, {"prompt": "Hi", "logit_bias": {"abc": 1}}, 400, "logit_bias", None),
    (COMPLETIONS, {"prompt": "Hi", "logit_bias": {"5": 1000}}, 400, "logit_bias", None),
    (COMPLETIONS, {"prompt": "Hi", "logit_bias": {"999999": 1}}, 400, "logit_bias", None),
    (COMPLETIONS, {"prompt": "Hi", "logprobs": 21}, 400, "logprobs", None),
    (COMPLETIONS, {"prompt": "Hi", "min_tokens": 10, "max_tokens": 5}, 400, "min_tokens", None),
    (COMPLETIONS, {"prompt": "Hi", "echo": "yes"}, 400, "echo", None),
    (COMPLETIONS, {"prompt": "Hi", "truncate_prompt_tokens": 0}, 400, "truncate_prompt_tokens", None),
    (COMPLETIONS, {"prompt": "Hi", "truncate_prompt_tokens": "x"}, 400, "truncate_prompt_tokens", None),
    (COMPLETIONS, {"prompt": "Hi", "truncate_prompt_tokens": 10**6}, 400, "truncate_prompt_tokens", None),
    (COMPLETIONS, {"prompt": "Hi", "best_of": 2}, 400, "best_of", "unsupported_parameter"),
    (COMPLETIONS, {"prompt": "Hi", "suffix": "end"}, 400, "suffix", "unsupported_parameter"),
    (COMPLETIONS, {"prompt": "Hi", "stream_options": {"include_usage": True}}, 400, "stream_options", None),
    (COMPLETIONS, {"prompt": "Hi", "stream": True, "stream_options": {"include_usage": 1}}, 400,
     "stream_options.include_usage", None),
    (COMPLETIONS, {"prompt": "fox " * 600}, 400, "prompt", "context_length_exceeded"),
    (COMPLETIONS, {"prompt": [5] * 600}, 400, "prompt", "context_length_exceeded"),
    (COMPLETIONS, {"prompt": "fox " * 600, "stream": True}, 400, "prompt", "context_length_exceeded"),
    (COMPLETIONS, {"prompt": "fox " * 15000}, 400, "prompt", "context_length_exceeded"),  # refused untokenized
    (COMPLETIONS, {"prompt": "Hi", "model": "gpt-4"}, 404, "model", "model_not_found"),
    (CHAT, {"messages": []}, 400, "messages", None),
    (CHAT, {}, 400, "messages", None),
    (CHAT, {"messages": "Hi"}, 400, "messages", None),
    (CHAT, {"messages": [{"content": "Hi"}]}, 400, "messages[0].role", None),
    (CHAT, {"messages": [{"role": "user"}]}, 400, "messages[0].content", None),
    (CHAT, {"messages": [{"role": "tool", "content": "{}"}]}, 400, "messages[0].tool_call_id", None),
    (CHAT, {"messages": [{"role": "assistant", "tool_calls": [{"id": "1", "type": "function", "function": {
        "name": "f", "arguments": "{not json"}}]}]}, 400, "messages[0].tool_calls[0].function.arguments", None),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     400, "messages[0].content[0]", "unsupported_parameter"),
    (CHAT, {"messages": MESSAGES, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tool_choice",
     None),  # "auto" without --enable-auto-tool-choice
    (CHAT, {"messages": MESSAGES, "tool_choice": "auto"}, 400, "tool_choice", None),
    (CHAT, {"messages": MESSAGES, "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400, "tool_choice.function.name", None),
    (CHAT, {"messages": MESSAGES, "tools": [{"type": "retrieval"}], "tool_choice": "required"}, 400, "tools[0]",
     None),
    (CHAT, {"messages": MESSAGES, "tools": [{"type": "function", "function": {"name": "f", "strict": "x"}}],
            "tool_choice": "required"}, 400, "tools[0].function.strict", None),
    (CHAT, {"messages": MESSAGES, "tools": [{"type": "function", "function": {"name": "f", "parameters": 3}}],
            "tool_choice": "required"}, 400, "tools[0].function.parameters", None),
    # A schema that does not compile, named as the request sent it (not structured_outputs.json).
    (CHAT, {"messages": MESSAGES, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"a": {"$ref": "#/$defs/none"}}}}}],
            "tool_choice": "required"}, 400, "tools", None),
    (CHAT, {"messages": MESSAGES, "tools": [{"type": "function", "function": {"name": "f"}}, {
        "type": "function", "function": {"name": "g", "parameters": {"type": "objekt"}}}],
            "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400, "tools[1].function.parameters", None),
    (CHAT, {"messages": MESSAGES, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": 5}}},
     400, "response_format.json_schema.schema", None),
    (COMPLETIONS, {"prompt": "Hi", "structured_outputs": {"json": "{"}}, 400, "structured_outputs.json", None),
    (COMPLETIONS, {"prompt": "Hi", "structured_outputs": {"regex": "a", "disable_any_whitespace": "x"}}, 400,
     "structured_outputs.disable_any_whitespace", None),  # once a ValueError that ended the engine
    (COMPLETIONS, {"prompt": "Hi", "structured_outputs": {"json_object": "x"}}, 400, "structured_outputs.json_object",
     None),
    # A lone surrogate ("\\ud800" in JSON) is not valid Unicode: the tokenizer's TypeError on it
    # ended the engine (or was a 500 on /tokenize).
    (COMPLETIONS, {"prompt": "Hi \ud800"}, 400, "prompt", None),
    (COMPLETIONS, {"prompt": ["\udc80abc"]}, 400, "prompt", None),
    (CHAT, {"messages": [{"role": "user", "content": "\ud800"}]}, 400, "messages", None),
    ("/tokenize", {"prompt": "\ud800"}, 400, "prompt", None),
    ("/tokenize", {"messages": [{"role": "user", "content": "\ud800"}]}, 400, "messages", None),
    (CHAT, {"messages": MESSAGES, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs", None),
    (CHAT, {"messages": MESSAGES, "top_logprobs": 2}, 400, "top_logprobs", None),
    (CHAT, {"messages": MESSAGES, "max_completion_tokens": -1}, 400, "max_completion_tokens", None),
    (CHAT, {"messages": MESSAGES, "max_tokens": 0}, 400, "max_tokens", None),
    (CHAT, {"messages": MESSAGES, "best_of": 2}, 400, "best_of", "unsupported_parameter"),
    (CHAT, {"messages": [{"role": "user", "content": "fox " * 600}]}, 400, "prompt", "context_length_exceeded"),
    (CHAT, {"messages": MESSAGES, "model": "other"}, 404, "model", "model_not_found"),
    (CHAT, {"messages": MESSAGES, "chat_template": "{{ messages }}"}, 400, "chat_template",
     "untrusted_chat_template"),
    ("/tokenize", {"messages": MESSAGES, "chat_template": "{{ messages }}"}, 400, "chat_template",
     "untrusted_chat_template"),
    (CHAT, {"messages": MESSAGES, "chat_template": 5}, 400, "chat_template", None),
    (CHAT, {"messages": MESSAGES, "chat_template_kwargs": ["a"]}, 400, "chat_template_kwargs", None),
    (CHAT, {"messages": MESSAGES, "continue_final_message": True}, 400, "continue_final_message", None),
    ("/tokenize", {"prompt": 5}, 400, "prompt", None),
    ("/tokenize", {"messages": []}, 400, "messages", None),
    ("/detokenize", {"tokens": [1, -5]}, 400, "tokens", None),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens", None),
    # each was a 500: a RecursionError in the schema's check or in json.loads, a TypeError
    (CHAT, {"messages": MESSAGES, "response_format": {"type": "json_schema", "json_schema": {
        "name": "deep", "schema": DEEP}}},
     400, "response_format.json_schema.schema", None),
    (CHAT, {"messages": [*MESSAGES, {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
        "name": "f", "arguments": "[" * 990 + "]" * 990}}]}]}, 400, "messages[1].tool_calls[0].function.arguments",
     None),
    (CHAT, {"messages": MESSAGES, "structured_outputs": {"choice": 5}}, 400, "structured_outputs.choice", None),
    (CHAT, {"messages": MESSAGES, "tools": [{"type": "function", "function": {"name": "deep", "parameters": DEEP}}],
            "tool_choice": {"type": "function", "function": {"name": "deep"}}}, 400, "tools[0].function.parameters",
     None),
]


@pytest.mark.parametrize(("path", "body", "status", "param", "code"), BAD_REQUESTS,
                         ids=[f"{i}-{p.rsplit('/', 1)[-1]}" for i, (p, *_) in enumerate(BAD_REQUESTS)])
def test_bad_request(url, path, body, status, param, code):
    assert_error(_post(url, path, body), status, param=param, code=code)


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_truncate_prompt_tokens_keeps_the_last_tokens(url, path):
    """A prompt past the model's length, cut to its last 8 tokens (it was once ignored)."""
    body = {"prompt": "fox " * 600} if path == COMPLETIONS else {"messages": [{"role": "user", "content": "fox " * 600}]}
    response = _post(url, path, {**body, "max_tokens": 2, "truncate_prompt_tokens": 8})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens"] == 8


def test_a_structured_option_sent_as_null_is_unset(url):
    body = {"prompt": "Hi", "max_tokens": 2, "structured_outputs": {"regex": "a+", "disable_any_whitespace": None}}
    response = _post(url, COMPLETIONS, body)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] in ("a", "aa")


def test_wrong_content_type_routes_and_methods(url):
    body = json.dumps({"prompt": "Hi"}).encode()
    for content_type in ("text/plain", "application/x-www-form-urlencoded", "application/json; charset=latin-1"):
        assert_error(_post(url, COMPLETIONS, body, headers={"Content-Type": content_type}), 400,
                     code="unsupported_content_type")
    assert_error(httpx2.get(f"{url}/no-such-route"), 404, code="not_found")
    assert_error(httpx2.post(f"{url}/v1/audio/transcriptions", json={}, headers=AUTH), 404, code="not_found")
    response = httpx2.get(f"{url}{COMPLETIONS}", headers=AUTH)
    assert_error(response, 405, code="method_not_allowed")
    assert "POST" in response.headers["allow"]
    assert_error(httpx2.delete(f"{url}/health"), 405)
    assert_error(_post(url, COMPLETIONS, {"prompt": "Hi"}, headers={"X-Request-Id": "has space"}), 400,
                 param="X-Request-Id")


def test_openai_sdk_sees_typed_errors(url):
    with openai.OpenAI(base_url=f"{url}/v1", api_key=KEYS[1], max_retries=0) as client:
        model = client.models.list().data[0].id
        with pytest.raises(openai.BadRequestError) as raised:
            client.chat.completions.create(model=model, messages=[])
        assert raised.value.body["param"] == "messages"
        with pytest.raises(openai.BadRequestError) as raised:
            client.completions.create(model=model, prompt="Hi", logprobs=25)
        assert raised.value.body["param"] == "logprobs"
        with pytest.raises(openai.NotFoundError) as raised:
            client.completions.create(model="gpt-4", prompt="Hi")
        assert raised.value.body["code"] == "model_not_found"


async def test_bad_input_does_not_disturb_a_valid_stream(url):
    """A valid stream runs while every bad request above is sent concurrently."""
    text = ""
    finish = None
    statuses = []
    async with httpx2.AsyncClient(headers=AUTH, timeout=60) as client:

        async def bad(path: str, body) -> None:
            content = body if isinstance(body, bytes) else json.dumps(body).encode()
            response = await client.post(f"{url}{path}", content=content,
                                         headers={"Content-Type": "application/json"})
            statuses.append(response.status_code)

        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                async with client.stream("POST", f"{url}{COMPLETIONS}", json={
                        "prompt": "Hello", "max_tokens": 64, "stream": True, "ignore_eos": True,
                        "temperature": 0}) as response:
                    assert response.status_code == 200
                    for path, body, *_ in BAD_REQUESTS:
                        nursery.start_soon(bad, path, body)
                    async for line in response.aiter_lines():
                        if line.startswith("data: {"):
                            choice = json.loads(line[6:])["choices"][0]
                            text += choice["text"]
                            finish = choice["finish_reason"] or finish
    assert finish == "length" and text
    assert len(statuses) == len(BAD_REQUESTS) and all(400 <= s < 500 for s in statuses), statuses


async def test_early_answers_do_not_stall_keep_alive_connections(url):
    """Answers given without reading the body (unknown route, wrong method, no key) must not
    leave keep-alive connections stuck: under hypercorn's trio worker about 1 in 100 such
    requests used to leave its connection stuck, and the next request on it hung."""
    requests = [
        ("POST", "/v1/no-such-route", AUTH),
        ("POST", "/v1/no-such-route", {}),
        ("DELETE", "/v1/completions", AUTH),
        ("POST", "/health", {}),
        ("POST", COMPLETIONS, {**AUTH, "Content-Type": "text/plain"}),
    ]
    statuses: list[int] = []
    limiter = trio.CapacityLimiter(16)
    async with httpx2.AsyncClient(timeout=10) as client:

        async def one(index: int) -> None:
            method, path, headers = requests[index % len(requests)]
            async with limiter:
                response = await client.request(method, f"{url}{path}", content=b'{"prompt": "x"}',
                                                headers=headers)
                statuses.append(response.status_code)

        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                for index in range(800):
                    nursery.start_soon(one, index)
    assert len(statuses) == 800 and set(statuses) <= {400, 401, 404, 405}


def test_a_body_over_the_limit_closes_its_connection_and_the_next_request_is_answered(url):
    """A 413 answers before the rest of the body is read, so the connection cannot carry another
    request: the answer says so (Connection: close) and the client's next request, on a new
    connection, is answered (on the same one it hung)."""
    with httpx2.Client(timeout=10, headers=AUTH) as client:
        for _ in range(3):
            big = client.post(f"{url}/tokenize", json={"prompt": "hi", "pad": "x" * 200_000})
            assert_error(big, 413, code="request_too_large")
            assert big.headers["connection"] == "close"
            assert client.post(f"{url}/tokenize", json={"prompt": "hi"}).status_code == 200
    # A client that ignores the header: the server closes its end once the body is in (the close
    # was once cancelled midway, and the connection stayed open, answering nothing more).
    address = httpx2.URL(url)
    body = json.dumps({"prompt": "hi", "pad": "x" * 100_000}).encode()
    with socket.create_connection((address.host, address.port), timeout=10) as raw:
        raw.sendall(f"POST /tokenize HTTP/1.1\r\nHost: x\r\nAuthorization: {AUTH['Authorization']}\r\n"
                    f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        received = b""
        while chunk := raw.recv(65536):  # a server that never closes: TimeoutError
            received += chunk
    assert received.startswith(b"HTTP/1.1 413") and b"connection: close" in received.lower(), received


def test_an_asyncio_client_sees_the_413_of_a_body_it_is_still_sending(url):
    """The 413 goes out as soon as the body passes the limit, and the connection closes once the
    client has sent the rest (a bounded wait). Closed at once, an asyncio client's write failed
    and it dropped the connection, 413 and all (ReadError)."""

    async def posts() -> list[int]:
        async with httpx2.AsyncClient(timeout=10, headers=AUTH) as client:
            statuses = []
            for _ in range(3):
                big = await client.post(f"{url}/tokenize", json={"prompt": "hi", "pad": "x" * 20_000_000})
                assert_error(big, 413, code="request_too_large")
                statuses.append((await client.post(f"{url}/tokenize", json={"prompt": "hi"})).status_code)
            return statuses

    assert asyncio.run(posts()) == [200, 200, 200]
