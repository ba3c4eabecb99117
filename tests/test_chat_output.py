"""Unit tests (sans-IO): the reasoning parsers and the assistant-message shaper that runs
them before the tool-call parser, whole and streamed in any cut (hypothesis): the streamed
deltas add up to the whole message, reasoning never reaches content, and a forced
tool_choice's JSON becomes calls (or stays text when max_tokens cut it); and the engine's chat
rendering with tools (the shipped template where the model's own ignores them)."""

from __future__ import annotations

import json

import hypothesis
import hypothesis.strategies as st
import pytest

from triode.engine.structured.reasoning import REASONING_PARSERS
from triode.frontend.openai.chat_output import ChatOutput
from triode.frontend.openai.tool_request import ToolPlan

TOOLS = ({"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}},
         {"type": "function", "function": {"name": "g"}})

# (reasoning parser, output, reasoning, content)
REASONING = [
    ("deepseek_r1", "<think>\nsmall steps\n</think>\n\nParis.", "\nsmall steps\n", "Paris."),
    ("deepseek_r1", "the prompt opened it</think>Paris.", "the prompt opened it", "Paris."),
    ("deepseek_r1", "never closed <thin", "never closed <thin", ""),
    ("qwen3", "<think>hmm</think>Yes", "hmm", "Yes"),
    ("qwen3", "  No thinking here. </think>", "", "  No thinking here. </think>"),
    ("qwen3", "<thinking is a word>", "", "<thinking is a word>"),
]


def cuts(text: str):
    return st.lists(st.integers(0, len(text)), max_size=10).map(
        lambda points: [text[a:b] for a, b in zip([0, *sorted(points)], [*sorted(points), len(text)], strict=True)]
    )


def run(output: ChatOutput, pieces: list[str]):
    deltas = [d for piece in pieces for d in output.feed(piece)] + output.finish()
    return deltas


@hypothesis.settings(max_examples=50, deadline=None)
@hypothesis.given(data=st.data())
@pytest.mark.parametrize("parser, text, reasoning, content", REASONING)
def test_reasoning_is_split_off_in_any_cut(parser, text, reasoning, content, data):
    whole = REASONING_PARSERS[parser]()
    whole.feed(text)
    whole.finish()
    assert (whole.reasoning, whole.content) == (reasoning, content)
    output = ChatOutput(reasoning_parser=parser)
    deltas = run(output, data.draw(cuts(text)))
    assert "".join(d.reasoning for d in deltas) == reasoning
    assert "".join(d.content for d in deltas) == content
    message = output.message()
    assert message["reasoning"] == message["reasoning_content"] == (reasoning or None)


@hypothesis.settings(max_examples=50, deadline=None)
@hypothesis.given(data=st.data())
def test_reasoning_then_a_hermes_call(data):
    text = '<think>use the tool</think>On it.<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>'
    output = ChatOutput(reasoning_parser="qwen3", tools=ToolPlan(mode="auto", tools=TOOLS, parser="hermes"))
    deltas = run(output, data.draw(cuts(text)))
    assert "".join(d.reasoning for d in deltas) == "use the tool"
    assert "".join(d.content for d in deltas) == "On it."
    message = output.message()
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == [
        ("f", {"x": 1})]
    assert output.finish_reason("stop") == "tool_calls" and output.finish_reason("length") == "length"


def test_forced_choices_build_their_schema_and_read_their_json():
    named = ToolPlan(mode="named", tools=TOOLS, named="f")
    assert named.constraint().json == TOOLS[0]["function"]["parameters"]
    output = ChatOutput(tools=named)
    assert run(output, ['{"x":', " 3}"])[0].tool_calls[0].name == "f"
    assert output.message()["content"] is None and json.loads(output.tool_calls[0].arguments) == {"x": 3}

    required = ToolPlan(mode="required", tools=TOOLS, parallel=False)
    schema = required.constraint().json
    assert schema["minItems"] == 1 and schema["maxItems"] == 1
    assert [option["properties"]["name"]["const"] for option in schema["items"]["anyOf"]] == ["f", "g"]
    output = ChatOutput(tools=required)
    run(output, ['[{"name": "g", "parameters": {}}]'])
    assert [(c.name, c.arguments) for c in output.tool_calls] == [("g", "{}")]

    cut = ChatOutput(tools=required)  # max_tokens ended it mid-JSON: it stays text
    assert "".join(d.content for d in run(cut, ['[{"name": "g", "par'])) == '[{"name": "g", "par'
    assert cut.tool_calls == [] and cut.finish_reason("length") == "length"


def test_a_template_that_ignores_tools_is_replaced_by_the_shipped_one(tiny_tokenizer):
    from triode.engine.chat_options import ChatOptions
    from triode.engine.inputs import InputProcessor

    processor = InputProcessor(tiny_tokenizer, max_model_len=512, vocab_size=len(tiny_tokenizer))
    messages = [
        {"role": "user", "content": "x?"},
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "2"},
    ]
    plain = processor.render_chat(ChatOptions(messages=[messages[0]]))
    assert "<tools>" not in plain
    rendered = processor.render_chat(ChatOptions(messages=messages, tools=TOOLS))
    assert '<tools>\n{"name": "f"' in rendered
    assert '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>' in rendered
    assert "<tool_response>\n2\n</tool_response>" in rendered and rendered.endswith("<|im_start|>assistant\n")
    own = "{% for m in messages %}{{ m['content'] }}{% endfor %}{{ tools | length }}"
    assert processor.render_chat(ChatOptions(messages=[messages[0]], tools=TOOLS, chat_template=own)) == "x?2"


@pytest.mark.parametrize("tools, field", [
    ([{"type": "retrieval"}], "tools[0]"),
    ([{"type": "function", "function": {"name": "no spaces"}}], "tools[0].function.name"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}], "tools[0].function.parameters"),
    ([TOOLS[0], TOOLS[0]], "tools"),
    ("f", "tools"),
])
def test_bad_tools_raise_before_anything_renders(tools, field):
    from triode.engine.chat_options import ChatOptions
    from triode.engine.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError) as caught:
        ChatOptions(messages=[{"role": "user", "content": "x"}], tools=tools)
    assert caught.value.field == field
