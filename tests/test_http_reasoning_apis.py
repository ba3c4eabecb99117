"""HTTP tests: reasoning through the Responses and Messages APIs, with the real SDKs, against
``triode serve`` on the default model with ``--reasoning-parser deepseek_r1``. That parser
reads an output as thinking until ``</think>``, which the 135M model never writes in a few
tokens: every output is all thinking, so each API must carry it in its own reasoning shape
(a ``reasoning`` item; a ``thinking`` block), equal to what chat completions call
``reasoning``, with the answer empty."""

from __future__ import annotations

import anthropic
import openai
import pytest

from tests.http_server import running, triode_serve

pytestmark = [pytest.mark.default_model]
QUESTION = "Is 7 a prime number?"


@pytest.fixture(scope="module")
def server():
    with running(triode_serve(None, "--max-model-len", "512", "--kv-cache-memory", "64MiB",
                              "--reasoning-parser", "deepseek_r1")) as server:
        yield server


@pytest.fixture(scope="module")
def reasoning(server) -> tuple[str, str]:
    """(the served model, the chat completion's reasoning for QUESTION in 12 tokens)."""
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as client:
        model = client.models.list().data[0].id
        message = client.chat.completions.create(model=model, messages=[{"role": "user", "content": QUESTION}],
                                                 max_completion_tokens=12, temperature=0.0).choices[0].message
    assert message.content == "" and message.model_extra["reasoning"]
    return model, message.model_extra["reasoning"]


def test_a_response_carries_the_thinking_as_a_reasoning_item(server, reasoning):
    model, thought = reasoning
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                       _strict_response_validation=True) as client:
        request = dict(model=model, input=QUESTION, max_output_tokens=12, temperature=0.0)
        whole = client.responses.create(**request)
        assert [item.type for item in whole.output] == ["reasoning", "message"]
        assert whole.output[0].content[0].text == thought and whole.output_text == ""
        assert whole.status == "incomplete" and whole.usage.output_tokens_details.reasoning_tokens > 0
        with client.responses.stream(**request) as stream:
            deltas = "".join(event.delta for event in stream if event.type == "response.reasoning_text.delta")
        assert deltas == thought


def test_a_message_carries_the_thinking_as_a_thinking_block(server, reasoning):
    model, thought = reasoning
    with anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0,
                             _strict_response_validation=True) as client:
        request = dict(model=model, max_tokens=12, messages=[{"role": "user", "content": QUESTION}],
                       extra_body={"temperature": 0.0})
        whole = client.messages.create(**request)
        assert [block.type for block in whole.content] == ["thinking", "text"]
        assert whole.content[0].thinking == thought and whole.content[1].text == ""
        assert whole.stop_reason == "max_tokens"
        with client.messages.stream(**request) as stream:
            deltas = "".join(event.thinking for event in stream if event.type == "thinking")
            final = stream.get_final_message()
        assert deltas == thought and final.content[0].thinking == thought
