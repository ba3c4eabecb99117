"""Unit tests (sans-IO): OpenAI's Responses API. Input items (and a stored history) read
into chat-template messages, every bad body a 400 naming its field; engine outputs shaped
into a response and its typed events, each event validated against the openai SDK's types
and the stream, cut anywhere and folded by the SDK's own stream state, equal to the whole
response; the store's bounds in number and age."""

from __future__ import annotations

import json

import hypothesis
import hypothesis.strategies as st
import openai
import pytest
from openai._models import validate_type
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import Response, ResponseStreamEvent

from tests.test_anthropic_protocol import output
from triode.frontend.openai.errors import APIError
from triode.frontend.openai.requests import ChatServing
from triode.frontend.responses.output import ResponseBuilder
from triode.frontend.responses.requests import parse_responses_request
from triode.frontend.responses.store import ResponseStore

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
AUTO = ChatServing(tool_call_parser="hermes", enable_auto_tool_choice=True)
CALL = {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'}
# parameters nested past json_nesting.MAX_DEPTH: refused once tool_choice turns them into a constraint
DEEP = {**WEATHER, "name": "deep", "parameters": json.loads('{"type":"object","properties":{"a":' * 100 + "{}" + "}}" * 100)}


def test_items_become_template_messages():
    request = parse_responses_request({
        "instructions": "Be brief.", "max_output_tokens": 20, "temperature": 0.5, "tools": [WEATHER],
        "input": [
            {"role": "developer", "content": "Use tools."},
            {"role": "user", "content": [{"type": "input_text", "text": "Weather in "},
                                         {"type": "input_text", "text": "Paris?"}]},
            {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Ask."}]},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking.",
                                                                  "annotations": []}]},
            CALL, {**CALL, "call_id": "c2", "arguments": '{"city": "Rome"}'},
            {"type": "function_call_output", "call_id": "c1", "output": "18 C"},
            {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "20 C"}]},
        ]}, serving=AUTO)
    engine = request.generation([], AUTO)
    assert engine.chat is not None and engine.tools is not None and engine.tools.mode == "auto"
    assert engine.chat.messages == (
        {"role": "system", "content": "Be brief."},
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "Ask.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
            {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "18 C"},
        {"role": "tool", "tool_call_id": "c2", "content": "20 C"},
    )
    assert engine.chat.chat_template is None and engine.chat.add_generation_prompt
    assert (engine.params.max_tokens, engine.params.temperature) == (20, 0.5)
    assert request.echo["tools"] == [WEATHER] and request.echo["tool_choice"] == "auto"


def test_a_history_comes_first_and_its_calls_count():
    history = [{"type": "message", "role": "user", "content": "Weather in Paris?"}, CALL]
    request = parse_responses_request({"input": [{"type": "function_call_output", "call_id": "c1",
                                                  "output": "18 C"}]})
    messages = request.generation(history, ChatServing()).chat.messages
    assert [m["role"] for m in messages] == ["user", "assistant", "tool"]
    with pytest.raises(APIError) as caught:
        request.generation([], ChatServing())
    assert caught.value.param == "input[0].call_id"


def test_choices_formats_and_reasoning():
    named = parse_responses_request({"input": "x", "tools": [WEATHER],
                                     "tool_choice": {"type": "function", "name": "get_weather"}})
    assert named.tools is not None and named.tools.mode == "named"
    assert named.params.structured_outputs.json == WEATHER["parameters"]
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    formatted = parse_responses_request({"input": "x", "text": {"format": {"type": "json_schema", "name": "a",
                                                                           "schema": schema}}})
    assert formatted.params.structured_outputs.json == schema
    assert parse_responses_request({"input": "x", "text": {"format": {"type": "json_object"}}}
                                   ).params.structured_outputs.json_object
    off = parse_responses_request({"input": "x", "reasoning": {"effort": "none"}})
    assert off.chat_template_kwargs == {"reasoning_effort": "none", "enable_thinking": False}
    background = parse_responses_request({"input": "x", "background": True})
    assert background.background and background.params.output_kind.name == "DELTA"


@pytest.mark.parametrize("fields, param", [
    ({"input": []}, "input"),
    ({"input": 3}, "input"),
    ({"input": [{"type": "computer_call", "id": "x"}]}, "input[0].type"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"input": [{"type": "function_call_output", "call_id": "c9", "output": "x"}]}, "input[0].call_id"),
    ({"input": [{**CALL, "arguments": "{not json"}]}, "input[0].arguments"),
    ({"input": [{**CALL, "call_id": ""}]}, "input[0].call_id"),
    ({"input": [{"type": "reasoning", "content": [{"type": "reasoning_text", "text": 1}]}]},
     "input[0].content[0].text"),
    ({"text": None, "input": "x", "reasoning": {"effort": "extreme"}}, "reasoning.effort"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [{**WEATHER, "name": "bad name"}]}, "tools[0].name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "other"}}, "tool_choice.name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "file_search"}}, "tool_choice.type"),
    ({"tools": [WEATHER]}, "tool_choice"),  # auto, and no tool-call parser
    ({"text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format.name"),
    ({"text": {"format": {"type": "yaml"}}}, "text.format"),
    ({"tools": [WEATHER], "tool_choice": "required", "text": {"format": {"type": "json_object"}}}, "text.format"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"temperature": "hot"}, "temperature"),
    ({"reasoning": {"effort": "extreme"}}, "reasoning.effort"),
    ({"truncation": "auto"}, "truncation"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"background": True, "store": False}, "background"),
    ({"background": True, "stream": True}, "background"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[" * 3000 + "]" * 3000}]},
     "input[0].arguments"),  # a RecursionError, once: HTTP 500
    ({"tools": [WEATHER, DEEP], "tool_choice": {"type": "function", "name": "deep"}}, "tools[1].parameters"),
    ({"tools": [DEEP], "tool_choice": "required"}, "tools"),  # it was structured_outputs.json
])
def test_bad_bodies_are_400s_naming_the_field(fields, param):
    with pytest.raises(APIError) as caught:
        request = parse_responses_request({"input": "Hi", **fields})
        request.generation([], ChatServing())
    assert (caught.value.status, caught.value.param) == (400, param), caught.value.message


CASES = [  # (request fields, serving, output text, finish, status, output item types)
    ({}, ChatServing(), "Paris is the capital.", "stop", "completed", ["message"]),
    ({}, ChatServing(reasoning_parser="qwen3"), "<think>It is Paris.</think>Paris.", "stop", "completed",
     ["reasoning", "message"]),
    ({}, ChatServing(), "Paris is", "length", "incomplete", ["message"]),
    ({"tools": [WEATHER]}, AUTO, 'Let me see. <tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}'
     '</tool_call>', "stop", "completed", ["message", "function_call"]),
    ({"tools": [WEATHER], "tool_choice": "required"}, ChatServing(reasoning_parser="qwen3"),
     '<think>Two.</think>[{"name": "get_weather", "parameters": {"city": "Rome"}}, '
     '{"name": "get_weather", "parameters": {"city": "Oslo"}}]', "stop", "completed",
     ["reasoning", "function_call", "function_call"]),
    ({}, ChatServing(reasoning_parser="deepseek_r1"), "all thinking, cut", "length", "incomplete",
     ["reasoning", "message"]),
    ({}, ChatServing(), "", "stop", "completed", ["message"]),
]


def comparable(response: dict) -> dict:
    """Each run names its items and calls anew, and has its own clock readings; the stream's final
    response is otherwise equal."""
    response = {key: value for key, value in response.items() if key not in ("created_at", "completed_at")}
    response["output"] = [{key: value for key, value in item.items() if key not in ("id", "call_id")}
                          for item in response["output"]]
    return response


@pytest.mark.parametrize("fields, serving, text, finish, status, items", CASES)
@hypothesis.given(data=st.data())
@hypothesis.settings(max_examples=25, deadline=None)
def test_the_event_stream_folds_into_the_whole_response(data, fields, serving, text, finish, status, items):
    request = parse_responses_request({"input": "Hi", **fields}, serving=serving)
    engine = request.generation([], serving)

    def builder() -> ResponseBuilder:
        return ResponseBuilder(engine, request.echo, response_id="resp_1", model="m", count_tokens=len)

    whole = builder().full(output(text, 9, finish=finish, cached=4))
    parsed = Response.model_validate(whole)
    assert [item.type for item in parsed.output] == items and parsed.status == status
    assert (parsed.usage.input_tokens, parsed.usage.input_tokens_details.cached_tokens,
            parsed.usage.output_tokens) == (12, 4, 9)
    reasoning = next((item.content[0].text for item in parsed.output if item.type == "reasoning"), "")
    assert parsed.usage.output_tokens_details.reasoning_tokens == min(len(reasoning), 9)  # counted by len here

    points = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=6)))
    pieces = [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]
    streaming = builder()
    events = streaming.start(output("", 0, cached=4))
    for index, piece in enumerate(pieces):
        last = index == len(pieces) - 1
        events += streaming.events(output(piece, 9 if last else 0, finish=finish if last else None, cached=4))
    assert [event["sequence_number"] for event in events] == list(range(len(events)))
    types = [event["type"] for event in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] == ("response.completed" if status == "completed" else "response.incomplete")
    assert types.count("response.output_item.added") == types.count("response.output_item.done") == len(items)
    state = ResponseStreamState(input_tools=[WEATHER] if "tools" in fields else [], text_format=openai.omit)
    for event in events:
        state.handle_event(validate_type(type_=ResponseStreamEvent, value=event))  # type: ignore[arg-type]
    final = events[-1]["response"]
    assert comparable(final) == comparable(whole)
    if status == "completed":
        assert state._completed_response is not None
        assert comparable(state._completed_response.model_dump(exclude_none=True, exclude={"output": {
            "__all__": {"parsed_arguments"}}}, by_alias=True)) == comparable(
            Response.model_validate(final).model_dump(exclude_none=True, by_alias=True))


def test_the_store_keeps_the_newest_within_its_age():
    now = [0.0]
    store = ResponseStore(max_size=2, max_age=10.0, clock=lambda: now[0])
    for index in range(3):
        now[0] += 1
        store.put({"id": f"r{index}"}, ())
    assert store.get("r0") is None and store.get("r1") is not None and store.get("r2") is not None
    now[0] = 5.0
    store.put({"id": "r1", "status": "again"}, ())  # replacing refreshes its age and place
    now[0] = 13.5
    assert store.get("r2") is None and store.get("r1").response == {"id": "r1", "status": "again"}
    now[0] = 15.5
    assert store.get("r1") is None
    assert store.statistics().evicted == 1 and store.statistics().expired == 2 and store.statistics().stored == 0
    assert not store.delete("r1")
    empty = ResponseStore(max_size=0, max_age=10.0)
    empty.put({"id": "r"}, ())
    assert empty.get("r") is None


def test_a_running_background_response_outlives_the_stores_bounds():
    now = [0.0]
    store = ResponseStore(max_size=1, max_age=10.0, clock=lambda: now[0])

    async def cancel() -> None: ...

    store.put({"id": "bg", "status": "in_progress"}, (), cancel=cancel)
    store.put({"id": "done", "status": "completed"}, ())  # over size: the oldest finished one goes
    assert store.get("bg") is not None and store.get("done") is None
    now[0] = 20.0
    assert store.get("bg") is not None  # past its age, still running
    store.put({"id": "bg", "status": "completed"}, ())  # it finished: an ordinary entry now
    store.put({"id": "next", "status": "completed"}, ())
    assert store.get("bg") is None and store.get("next") is not None
    assert store.statistics().evicted == 2
