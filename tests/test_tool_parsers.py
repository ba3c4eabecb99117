"""Unit tests (sans-IO): each tool-call parser on recorded model outputs, whole and streamed
in every cut hypothesis finds; streamed deltas add up to the whole result, calls arrive as
OpenAI's deltas (id and name, then arguments), markup never reaches content, and malformed
calls stay text."""

from __future__ import annotations

import json

import hypothesis
import hypothesis.strategies as st
import pytest

from triode.frontend.openai.tool_parsers import TOOL_PARSERS, parse

WEATHER = {"city": "Paris", "unit": "celsius"}
DEEP = "[" * 1100

# (parser, model output, expected content, expected calls as (name, arguments))
RECORDED = [
    ("hermes", 'I will look it up.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
               '"unit": "celsius"}}\n</tool_call>', "I will look it up.", [("get_weather", WEATHER)]),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
               '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>',
     "", [("get_weather", WEATHER), ("get_time", {"zone": "CET"})]),
    ("hermes", '<tool_call>\n{"name": "search", "arguments": {"q": "ü <b>"}}', "", [("search", {"q": "ü <b>"})]),
    ("hermes", "The answer is 42.", "The answer is 42.", []),
    ("hermes", "Use <tool_call> tags like <tool", "Use <tool_call> tags like <tool", []),  # malformed
    ("hermes", '<tool_call>{"name": "f", "arguments": [1]}</tool_call> then', '<tool_call>{"name": "f", '
               '"arguments": [1]}</tool_call> then', []),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}', "",
     [("get_weather", WEATHER)]),
    ("llama3_json", '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": 1}}', "",
     [("a", {}), ("b", {"x": 1})]),
    ("llama3_json", "{not json} is what I said", "{not json} is what I said", []),
    ("llama3_json", "Sure: no tools needed.", "Sure: no tools needed.", []),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}]', "",
     [("get_weather", WEATHER)]),
    ("mistral", 'Checking.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}'
                '[TOOL_CALLS]get_time[ARGS]{"zone": "CET"}', "Checking.",
     [("get_weather", WEATHER), ("get_time", {"zone": "CET"})]),
    ("mistral", "[TOOL_CALLS] oops", "[TOOL_CALLS] oops", []),
    # nested past json_nesting's bound (a RecursionError, once: HTTP 500): text, not calls
    *((parser, text, text, []) for parser, text in (
        ("hermes", "<tool_call>" + DEEP),
        ("hermes", '<tool_call>{"name": "f", "arguments": "' + DEEP + '"}</tool_call>'),
        ("hermes", '<tool_call>{"name": "f", "arguments": {"a": ' + DEEP + "]" * 1100 + "}}</tool_call>"),
        ("mistral", "[TOOL_CALLS]" + DEEP + "]" * 1100),
        ("llama3_json", '{"name": "a", "parameters": ' + DEEP + "]" * 1100 + "}"),
    )),
]


def named(calls) -> list[tuple[str, dict]]:
    return [(call.name, json.loads(call.arguments)) for call in calls]


@pytest.mark.parametrize("parser, text, content, calls", RECORDED)
def test_whole_outputs(parser, text, content, calls):
    got_content, got_calls = parse(TOOL_PARSERS[parser](), text)
    assert got_content == content
    assert named(got_calls) == calls
    assert len({call.id for call in got_calls}) == len(got_calls)


def cuts(text: str):
    return st.lists(st.integers(0, len(text)), max_size=12).map(
        lambda points: [text[a:b] for a, b in zip([0, *sorted(points)], [*sorted(points), len(text)], strict=True)]
    )


@hypothesis.settings(max_examples=60, deadline=None)
@hypothesis.given(data=st.data())
@pytest.mark.parametrize("parser, text, content, calls", RECORDED)
def test_streamed_in_any_cut_adds_up_to_the_whole(parser, text, content, calls, data):
    pieces = data.draw(cuts(text))
    stream = TOOL_PARSERS[parser]()
    deltas = [d for piece in pieces for d in stream.feed(piece)] + stream.finish()
    assert "".join(d.content for d in deltas) == content
    markup = {"hermes": "<tool_call>", "llama3_json": '"parameters"', "mistral": "[TOOL_CALLS]"}[parser]
    if calls:
        assert all(markup not in d.content for d in deltas)
    streamed: dict[int, dict] = {}
    for delta in (c for d in deltas for c in d.tool_calls):
        if delta.index not in streamed:
            assert delta.id and delta.name and not delta.arguments  # id and name come first
            streamed[delta.index] = {"name": delta.name, "arguments": ""}
        else:
            assert delta.id is None and delta.name is None
            streamed[delta.index]["arguments"] += delta.arguments
    assert sorted(streamed) == list(range(len(calls)))
    assert [(streamed[i]["name"], json.loads(streamed[i]["arguments"])) for i in sorted(streamed)] == calls


def test_mistral_ids_are_nine_letters_or_digits():
    _, calls = parse(TOOL_PARSERS["mistral"](), '[TOOL_CALLS][{"name": "f", "arguments": {}}]')
    assert len(calls[0].id) == 9 and calls[0].id.isalnum()
