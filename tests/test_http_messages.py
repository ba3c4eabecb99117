"""HTTP tests: Anthropic's Messages API through the real ``anthropic`` SDK (strict response
validation on) against ``triode serve`` on the default model (the protocol server: hermes
tool parser, auto tool choice). A message equals the chat completion of the same
conversation; streamed equals whole; tools (named, any, a tool_result round trip);
stop_sequences; output_config.format; count_tokens; errors in Anthropic's shape."""

from __future__ import annotations

import json

import anthropic
import httpx2
import jsonschema
import pytest

pytestmark = [pytest.mark.default_model]

WEATHER = {"name": "get_weather", "description": "The current weather in a city.",
           "input_schema": {"type": "object",
                            "properties": {"city": {"type": "string", "maxLength": 20},
                                           "unit": {"enum": ["celsius", "fahrenheit"]}},
                            "required": ["city", "unit"], "additionalProperties": False}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
GREEDY = {"extra_body": {"temperature": 0.0}}  # the SDK no longer sends sampling fields itself


@pytest.fixture(scope="module")
def client(protocol_server):
    with anthropic.Anthropic(base_url=protocol_server.url, api_key="unused", max_retries=0,
                             _strict_response_validation=True) as client:
        yield client


@pytest.fixture(scope="module")
def model(protocol_client) -> str:
    return protocol_client.models.list().data[0].id


def test_a_message_is_the_chat_completion_of_the_same_conversation(client, protocol_client, model):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    message = client.messages.create(model=model, max_tokens=24, system="Answer in one sentence.",
                                     messages=messages, **GREEDY)
    chat = protocol_client.chat.completions.create(
        model=model, max_completion_tokens=24, temperature=0.0,
        messages=[{"role": "system", "content": "Answer in one sentence."}, *messages])
    assert len(message.content) == 1 and message.content[0].type == "text"
    assert message.content[0].text == chat.choices[0].message.content
    assert message.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[chat.choices[0].finish_reason]
    usage = message.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == chat.usage.prompt_tokens
    assert usage.output_tokens == chat.usage.completion_tokens
    assert message.id.startswith("msg_") and message.model == model and message.role == "assistant"
    counted = client.messages.count_tokens(model=model, system="Answer in one sentence.", messages=messages)
    assert counted.input_tokens == chat.usage.prompt_tokens


def test_streamed_equals_whole(client, model):
    request = dict(model=model, max_tokens=40, messages=[{"role": "user", "content": "Name three colours."}],
                   **GREEDY)
    whole = client.messages.create(**request)
    with client.messages.stream(**request) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text == final.content[0].text
    assert (final.stop_reason, final.usage.output_tokens) == (whole.stop_reason, whole.usage.output_tokens)


def test_a_named_tool_is_called_and_its_result_answered(client, model):
    request = dict(model=model, max_tokens=60, tools=[WEATHER], messages=ASK,
                   tool_choice={"type": "tool", "name": "get_weather"}, **GREEDY)
    message = client.messages.create(**request)
    assert message.stop_reason == "tool_use"
    (call,) = message.content
    assert call.type == "tool_use" and call.name == "get_weather"
    jsonschema.validate(call.input, WEATHER["input_schema"])
    with client.messages.stream(**request) as stream:
        partial = "".join(event.partial_json for event in stream if event.type == "input_json")
        final = stream.get_final_message()
    assert json.loads(partial) == final.content[0].input == call.input
    answer = client.messages.create(model=model, max_tokens=30, tools=[WEATHER], tool_choice={"type": "none"},
                                    messages=[*ASK, {"role": "assistant", "content": message.content},
                                              {"role": "user", "content": [
                                                  {"type": "tool_result", "tool_use_id": call.id,
                                                   "content": "18 degrees and sunny"}]}], **GREEDY)
    assert answer.content[0].type == "text" and answer.content[0].text
    assert answer.stop_reason in ("end_turn", "max_tokens")


def test_any_tool_makes_calls_that_validate(client, model):
    with client.messages.stream(model=model, max_tokens=80, tools=[WEATHER], tool_choice={"type": "any"},
                                messages=ASK) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use" and final.content
    for block in final.content:
        assert block.type == "tool_use" and block.name == "get_weather"
        jsonschema.validate(block.input, WEATHER["input_schema"])


def test_stop_sequences_and_output_format(client, model):
    request = dict(model=model, max_tokens=40, messages=[{"role": "user", "content": "Name three colours."}],
                   **GREEDY)
    text = client.messages.create(**request).content[0].text
    words = text.split()
    assert len(words) > 2
    stopped = client.messages.create(**request, stop_sequences=[words[2]])
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", words[2])
    assert stopped.content[0].text == text[:text.index(words[2])]
    schema = {"type": "object", "properties": {"colours": {"type": "array", "items": {"type": "string"},
                                                          "maxItems": 3}}, "required": ["colours"]}
    formatted = client.messages.create(model=model, max_tokens=60, messages=request["messages"],
                                       output_config={"format": {"type": "json_schema", "schema": schema}})
    assert formatted.stop_reason == "end_turn"
    jsonschema.validate(json.loads(formatted.content[0].text), schema)


def anthropic_error(response: httpx2.Response, status: int, kind: str, says: str) -> None:
    assert response.status_code == status, response.text
    body = response.json()
    assert body == {"type": "error", "error": {"type": kind, "message": body["error"]["message"]}}
    assert says in body["error"]["message"], body


def test_errors_come_in_anthropics_shape(protocol_server, client, model):
    url = f"{protocol_server.url}/v1/messages"
    anthropic_error(httpx2.post(url, json={"model": model, "messages": ASK}), 400, "invalid_request_error",
                    "max_tokens: is required")
    anthropic_error(httpx2.post(url, json={"model": "claude-x", "max_tokens": 4, "messages": ASK}), 404,
                    "not_found_error", "claude-x")
    anthropic_error(httpx2.post(url, json={"model": model, "max_tokens": 4, "messages": ASK,
                                           "output_config": {"format": {"type": "json_schema",
                                                                        "schema": {"type": "objekt"}}}}),
                    400, "invalid_request_error", "output_config.format.schema")
    too_long = [{"role": "user", "content": "word " * 2000}]
    anthropic_error(httpx2.post(url, json={"model": model, "max_tokens": 4, "messages": too_long}), 400,
                    "invalid_request_error", "maximum length")
    # "\\ud800", a lone surrogate: not valid Unicode, and once the end of the engine
    surrogate = {"model": model, "messages": [{"role": "user", "content": "\ud800"}]}
    for path, body in ((url, {**surrogate, "max_tokens": 4}), (url + "/count_tokens", surrogate)):
        anthropic_error(httpx2.post(path, content=json.dumps(body).encode(), headers={"Content-Type": "application/json"}),
                        400, "invalid_request_error", "lone surrogate")
    anthropic_error(httpx2.get(url), 405, "invalid_request_error", "GET")
    anthropic_error(httpx2.post(url + "/batches", json={}), 404, "not_found_error", "no such route")
    anthropic_error(httpx2.post(url, content=b"{", headers={"Content-Type": "application/json"}), 400,
                    "invalid_request_error", "not valid JSON")
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(model=model, max_tokens=8, messages=[{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "x"}]}])
    assert "tool_use_id" in caught.value.message
    # the OpenAI routes keep OpenAI's shape
    assert set(httpx2.post(f"{protocol_server.url}/v1/chat/completions", json={}).json()) == {"error"}
