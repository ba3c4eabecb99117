"""HTTP tests: tool calling and reasoning through the real openai SDK (strict response
validation on) against ``triode serve`` on the default model with
``--enable-auto-tool-choice --tool-call-parser hermes`` (and one with ``--reasoning-parser
qwen3`` for reasoning). SmolLM2's own template ignores tools, so triode's shipped ChatML
tool template renders them; a named and a "required" tool_choice are enforced by the
engine, so their calls parse and validate whatever the 135M model would have said."""

from __future__ import annotations

import json

import httpx2
import jsonschema
import openai
import pytest

from tests.http_server import running, triode_serve

pytestmark = [pytest.mark.default_model]

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20},
                           "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The current time in a time zone.",
        "parameters": {"type": "object", "properties": {"zone": {"enum": ["CET", "UTC", "EST"]}},
                       "required": ["zone"], "additionalProperties": False},
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris, and what time is it there?"}]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in (WEATHER, TIME)}


@pytest.fixture(scope="module")
def client(protocol_client):
    return protocol_client


def model(client) -> str:
    return client.models.list().data[0].id


def check_calls(calls, names=None) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert names is None or call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def streamed_calls(chunks) -> tuple[str, dict[int, dict], list[str]]:
    content, calls, finishes = "", {}, []
    for chunk in chunks:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or ():
                if delta.index not in calls:
                    assert delta.id and delta.function.name  # id and name come first
                    calls[delta.index] = {"id": delta.id, "name": delta.function.name, "arguments": ""}
                else:
                    assert delta.id is None
                calls[delta.index]["arguments"] += delta.function.arguments or ""
            if choice.finish_reason:
                finishes.append(choice.finish_reason)
    return content, calls, finishes


@pytest.mark.parametrize("tool_choice, names", [
    ({"type": "function", "function": {"name": "get_weather"}}, {"get_weather"}),
    ("required", {"get_weather", "get_time"}),
])
def test_forced_tool_choices_give_calls_that_validate_streamed_and_not(client, tool_choice, names):
    request = dict(model=model(client), messages=ASK, tools=[WEATHER, TIME], tool_choice=tool_choice,
                   max_completion_tokens=120, temperature=0.0)
    whole = client.chat.completions.create(**request).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content is None
    check_calls(whole.message.tool_calls, names)
    content, calls, finishes = streamed_calls(client.chat.completions.create(**request, stream=True))
    assert content == "" and finishes == ["tool_calls"]
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls]


def test_required_at_temperature_one_without_parallel_calls_gives_one_call(client):
    completion = client.chat.completions.create(
        model=model(client), messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
        parallel_tool_calls=False, max_completion_tokens=120, temperature=1.0, seed=2, n=3,
    )
    assert len(completion.choices) == 3
    for choice in completion.choices:
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
        check_calls(choice.message.tool_calls)


def test_a_conversation_with_a_call_and_its_result_is_answered(client):
    messages = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"},
    ]
    completion = client.chat.completions.create(model=model(client), messages=messages, tools=[WEATHER],
                                                tool_choice="none", max_completion_tokens=40, temperature=0.0)
    message = completion.choices[0].message
    assert message.content and not message.tool_calls


def test_auto_tool_choice_finds_hermes_calls_in_the_text(client):
    # The 135M model rarely calls a tool on its own, so a regex makes its output a Hermes call
    # with text before it: what the parser must find, whole and streamed.
    call = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "Paris", "unit": "celsius"\}\}\n</tool_call>'
    request = dict(model=model(client), messages=ASK, tools=[WEATHER, TIME], max_completion_tokens=80,
                   temperature=0.0, extra_body={"structured_outputs": {"regex": "Let me check[.]\n" + call}})
    whole = client.chat.completions.create(**request).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content == "Let me check."
    (found,) = whole.message.tool_calls
    assert (found.function.name, json.loads(found.function.arguments)) == (
        "get_weather", {"city": "Paris", "unit": "celsius"})
    content, calls, finishes = streamed_calls(client.chat.completions.create(**request, stream=True))
    assert content == "Let me check." and "<tool_call>" not in content and finishes == ["tool_calls"]
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [("get_weather", found.function.arguments)]


@pytest.fixture(scope="module")
def reasoning_client():
    with running(triode_serve(None, "--max-model-len", "1024", "--kv-cache-memory", "128MiB",
                              "--reasoning-parser", "qwen3")) as server, \
            openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                          _strict_response_validation=True) as client:
        yield client


def test_reasoning_goes_to_its_own_field_and_the_constraint_holds_after_it(reasoning_client):
    # The 135M model does not reason; the regex makes it think, in the answer's place or in
    # the thinking block the reasoning parser's grammar offers before it.
    client = reasoning_client
    request = dict(model=model(client), messages=[{"role": "user", "content": "Is 7 prime?"}],
                   max_completion_tokens=60, temperature=0.0,
                   extra_body={"structured_outputs": {"regex": r"<think>[a-z ]{3,40}</think>(Yes|No)\."}})
    message = client.chat.completions.create(**request).choices[0].message
    assert message.content in ("Yes.", "No.")
    extra = message.model_extra
    assert extra["reasoning"] == extra["reasoning_content"] and 3 <= len(extra["reasoning"]) <= 40
    reasoning, content = "", ""
    for chunk in client.chat.completions.create(**request, stream=True):
        for choice in chunk.choices:
            reasoning += (choice.delta.model_extra or {}).get("reasoning") or ""
            content += choice.delta.content or ""
    assert (reasoning, content) == (extra["reasoning"], message.content)


@pytest.mark.parametrize("extra, param", [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
     "tool_choice.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format"),
])
def test_bad_tool_requests_get_a_400_naming_the_parameter(client, extra, param):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=model(client), messages=ASK, max_completion_tokens=5,
                                       extra_body=extra)
    assert caught.value.body["param"] == param, caught.value.body


def test_tokenize_renders_the_tools_too(protocol_server):
    messages = [*ASK]
    plain = httpx2.post(f"{protocol_server.url}/tokenize", json={"messages": messages}).json()
    with_tools = httpx2.post(f"{protocol_server.url}/tokenize", json={"messages": messages, "tools": [WEATHER]})
    assert with_tools.json()["count"] > plain["count"] + 50  # the tool's signature is in the prompt
    bad = httpx2.post(f"{protocol_server.url}/tokenize", json={"messages": messages, "tools": [{"type": "x"}]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tools[0]"
