"""Unit tests (sans-IO): Anthropic's Messages API read into chat messages, tools and
sampling, with every bad body a 400 naming its field; and engine outputs shaped into a
message and its event stream. The stream, cut anywhere and folded by the anthropic SDK's own
accumulator, equals the whole message, with thinking, text and tool_use blocks."""

from __future__ import annotations

import json

import hypothesis
import hypothesis.strategies as st
import pytest
from anthropic.lib.streaming._messages import accumulate_event
from anthropic.types import Message

from triode.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from triode.frontend.anthropic.errors import error_body
from triode.frontend.anthropic.messages import MessageBuilder
from triode.frontend.anthropic.requests import parse_count_tokens, parse_messages_request
from triode.frontend.openai.errors import APIError
from triode.frontend.openai.requests import ChatServing

WEATHER = {"name": "get_weather", "description": "The weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
AUTO = ChatServing(tool_call_parser="hermes", enable_auto_tool_choice=True)
# a schema nested past json_nesting.MAX_DEPTH: refused once tool_choice turns it into a constraint
DEEP = {**WEATHER, "name": "deep", "input_schema": json.loads('{"type":"object","properties":{"a":' * 100 + "{}" + "}}" * 100)}


def body(**fields):
    return {"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": "Hi"}], **fields}


def test_a_conversation_with_tools_becomes_template_messages():
    request = parse_messages_request(body(
        system=[{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Use tools."}],
        tools=[WEATHER], tool_choice={"type": "any", "disable_parallel_tool_use": True},
        stop_sequences=["\n\n"], temperature=0.5, top_k=4,
        messages=[
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "A tool knows.", "signature": "x"},
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Paris"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "18 C"}]},
                {"type": "text", "text": "And tomorrow?"}]},
        ]), serving=AUTO)
    assert request.chat is not None and request.tools is not None
    assert request.chat.messages == (
        {"role": "system", "content": "Be brief.\nUse tools."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "A tool knows.",
         "tool_calls": [{"id": "t1", "type": "function",
                         "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "18 C"},
        {"role": "user", "content": "And tomorrow?"},
    )
    assert (request.tools.mode, request.tools.parallel) == ("required", False)
    assert request.chat.add_generation_prompt and not request.chat.continue_final_message
    params = request.params
    assert (params.max_tokens, params.temperature, params.top_k, params.stop) == (16, 0.5, 4, ("\n\n",))
    assert params.structured_outputs is not None and params.structured_outputs.json["maxItems"] == 1


def test_choices_thinking_prefill_and_output_format():
    named = parse_messages_request(body(tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"}))
    assert named.tools is not None and (named.tools.mode, named.tools.named) == ("named", "get_weather")
    assert named.params.structured_outputs.json == WEATHER["input_schema"]
    none = parse_messages_request(body(tools=[WEATHER], tool_choice={"type": "none"}))
    assert none.tools is not None and none.tools.mode == "none" and none.params.structured_outputs is None
    assert parse_messages_request(body(tools=[WEATHER]), serving=AUTO).tools.mode == "auto"
    prefill = parse_messages_request(body(
        messages=[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello,"}],
        thinking={"type": "disabled"}))
    assert prefill.chat.continue_final_message and not prefill.chat.add_generation_prompt
    assert prefill.chat.chat_template_kwargs == {"enable_thinking": False}
    thinking = parse_messages_request(body(thinking={"type": "enabled", "budget_tokens": 8}))
    assert thinking.chat.chat_template_kwargs == {"enable_thinking": True}
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    formatted = parse_messages_request(body(output_config={"format": {"type": "json_schema", "schema": schema},
                                                           "effort": "low"}))
    assert formatted.params.structured_outputs.json == schema
    model, chat = parse_count_tokens({"model": "m", "messages": [{"role": "user", "content": "Hi"}],
                                      "tools": [WEATHER]})
    assert model == "m" and chat.tools is not None and chat.tools[0]["function"]["name"] == "get_weather"


@pytest.mark.parametrize("fields, param", [
    ({"max_tokens": None}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"model": None}, "model"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t9", "content": "x"}]}]},
     "messages[0].content[0].tool_use_id"),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": "x"}]}]},
     "messages[0].content[0].input"),
    ({"system": [{"type": "image"}]}, "system[0]"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
    ({"tools": [{"name": "f"}]}, "tools[0].input_schema"),
    ({"tools": [{"name": "bad name", "input_schema": {"type": "object"}}]}, "tools[0].name"),
    ({"tools": [{"name": "f", "input_schema": {"type": "array"}}]}, "tools[0].input_schema"),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "other"}}, "tool_choice.name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "sometimes"}}, "tool_choice.type"),
    ({"tools": [WEATHER, DEEP], "tool_choice": {"type": "tool", "name": "deep"}}, "tools[1].input_schema"),
    ({"tools": [DEEP], "tool_choice": {"type": "any"}}, "tools"),  # it was structured_outputs.json
    ({"tools": [WEATHER]}, "tool_choice"),  # auto, and the server has no tool-call parser
    ({"tool_choice": {"type": "any"}}, "tool_choice"),
    ({"thinking": {"type": "enabled", "budget_tokens": 16}}, "thinking.budget_tokens"),
    ({"thinking": {"type": "deep"}}, "thinking.type"),
    ({"stop_sequences": "\n"}, "stop_sequences"),
    ({"temperature": -1}, "temperature"),
    ({"output_config": {"format": {"type": "json_schema"}}}, "output_config.format"),
    ({"tools": [WEATHER], "tool_choice": {"type": "any"},
      "output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}}}, "output_config.format"),
])
def test_bad_bodies_are_400s_naming_the_field(fields, param):
    with pytest.raises(APIError) as caught:
        parse_messages_request({k: v for k, v in body(**fields).items() if v is not None})
    error = caught.value
    assert (error.status, error.param) == (400, param), error.message
    assert error_body(error) == {"type": "error", "error": {"type": "invalid_request_error",
                                                             "message": error.message}}


def test_error_types_follow_anthropics_names():
    names = {status: error_body(APIError(status, "m"))["error"]["type"] for status in (401, 404, 413, 500, 503)}
    assert names == {401: "authentication_error", 404: "not_found_error", 413: "request_too_large",
                     500: "api_error", 503: "overloaded_error"}


def output(text: str, tokens: int, *, finish: str | None = None, stop: str | int | None = None,
           cached: int = 0) -> RequestOutput:
    completion = CompletionOutput(index=0, text=text, token_ids=tuple(range(tokens)), finish_reason=finish,
                                  stop_reason=stop)
    return RequestOutput(request_id="r", prompt=None, prompt_token_ids=(1,) * 12, prompt_logprobs=None,
                         outputs=(completion,), finished=finish is not None, metrics=RequestMetrics(arrival_time=0.0),
                         num_cached_tokens=cached)


# (request fields, serving, the whole output text, finish, stop, the content block types, stop_reason)
CASES = [
    ({}, ChatServing(), "Paris is the capital.", "stop", None, ["text"], "end_turn"),
    ({}, ChatServing(reasoning_parser="qwen3"), "<think>It is Paris.</think>Paris.", "length", None,
     ["thinking", "text"], "max_tokens"),
    ({"stop_sequences": ["!"]}, ChatServing(), "Paris", "stop", "!", ["text"], "stop_sequence"),
    ({"tools": [WEATHER]}, AUTO, 'Let me see. <tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}'
     '</tool_call>', "stop", None, ["text", "tool_use"], "tool_use"),
    ({"tools": [WEATHER], "tool_choice": {"type": "any"}},
     ChatServing(reasoning_parser="qwen3"),
     '<think>Two cities.</think>[{"name": "get_weather", "parameters": {"city": "Rome"}}, '
     '{"name": "get_weather", "parameters": {"city": "Oslo"}}]', "stop", None,
     ["thinking", "tool_use", "tool_use"], "tool_use"),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "get_weather"}}, ChatServing(),
     '{"city": "Ro', "length", None, ["text"], "max_tokens"),
    ({}, ChatServing(reasoning_parser="deepseek_r1"), "all thinking, cut", "length", None, ["thinking", "text"],
     "max_tokens"),
    ({}, ChatServing(), "", "stop", 2, ["text"], "end_turn"),
]


@pytest.mark.parametrize("fields, serving, text, finish, stop, blocks, reason", CASES)
@hypothesis.given(data=st.data())
@hypothesis.settings(max_examples=25, deadline=None)
def test_the_event_stream_folds_into_the_whole_message(data, fields, serving, text, finish, stop, blocks, reason):
    request = parse_messages_request(body(**fields), serving=serving)
    whole = MessageBuilder(request, message_id="msg_1", model="m").full(
        output(text, 9, finish=finish, stop=stop, cached=4))
    message = Message.model_validate(whole)
    assert [block.type for block in message.content] == blocks
    assert (message.stop_reason, message.stop_sequence) == (reason, stop if isinstance(stop, str) else None)
    assert (message.usage.input_tokens, message.usage.cache_read_input_tokens, message.usage.output_tokens) == (
        8, 4, 9)

    points = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=6)))
    pieces = [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]
    builder = MessageBuilder(request, message_id="msg_1", model="m")
    events = builder.start(output("", 0, cached=4))
    for index, piece in enumerate(pieces):
        last = index == len(pieces) - 1
        events += builder.events(output(piece, 9 if last else 0, finish=finish if last else None,
                                        stop=stop if last else None, cached=4))
    types = [event["type"] for event in events]
    assert types[0] == "message_start" and types[-2:] == ["message_delta", "message_stop"]
    assert types.count("content_block_start") == types.count("content_block_stop") == len(blocks)
    snapshot, buffers = None, {}
    for event in events:
        snapshot = accumulate_event(event=event, current_snapshot=snapshot, json_bufs=buffers)
    assert snapshot is not None
    assert without_call_ids(snapshot.model_dump(exclude_none=True)) == without_call_ids(
        message.model_dump(exclude_none=True))


def without_call_ids(message: dict) -> dict:
    """Each run of the output machine names its calls anew."""
    for block in message["content"]:
        if block["type"] == "tool_use":
            assert block.pop("id").startswith("call_")
    return message


def test_an_aborted_output_is_an_error_not_a_stop_reason():
    builder = MessageBuilder(parse_messages_request(body()), message_id="msg_1", model="m")
    with pytest.raises(APIError) as caught:
        builder.full(output("Par", 1, finish="abort"))
    assert caught.value.status == 503
