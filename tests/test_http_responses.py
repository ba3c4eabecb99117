"""HTTP tests: OpenAI's Responses API through the real ``openai`` SDK (strict response
validation on) and the OpenAI Agents SDK, against ``triode serve`` on the default model (the
protocol server: hermes tool parser, auto tool choice). A response equals the chat
completion of the same conversation; streamed (the SDK's stream helpers) equals whole;
function tools with a function_call_output round trip; text.format through the SDK's
``parse``; previous_response_id, retrieve and delete; background and cancel; an Agent with a
function tool run to completion; errors in OpenAI's shape."""

from __future__ import annotations

import asyncio
import json

import httpx2
import jsonschema
import openai
import pydantic
import pytest
import trio

from tests.http_server import ametric, await_condition

pytestmark = [pytest.mark.default_model]

WEATHER = {"type": "function", "name": "get_weather", "description": "The current weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                          "required": ["city"], "additionalProperties": False}}
ASK = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def client(protocol_client):
    return protocol_client


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


def test_a_response_is_the_chat_completion_of_the_same_conversation(client, model):
    response = client.responses.create(model=model, instructions="Answer in one sentence.",
                                       input="What is the capital of France?", max_output_tokens=24,
                                       temperature=0.0)
    chat = client.chat.completions.create(
        model=model, max_completion_tokens=24, temperature=0.0,
        messages=[{"role": "system", "content": "Answer in one sentence."},
                  {"role": "user", "content": "What is the capital of France?"}])
    assert response.output_text == chat.choices[0].message.content
    assert response.status == {"stop": "completed", "length": "incomplete"}[chat.choices[0].finish_reason]
    assert (response.usage.input_tokens, response.usage.output_tokens) == (
        chat.usage.prompt_tokens, chat.usage.completion_tokens)
    assert response.id.startswith("resp_") and response.model == model and response.store
    assert [item.type for item in response.output] == ["message"]


def test_streamed_equals_whole(client, model):
    request = dict(model=model, input="What is the capital of France?", max_output_tokens=40, temperature=0.0)
    whole = client.responses.create(**request)
    with client.responses.stream(**request) as stream:
        deltas = "".join(event.delta for event in stream if event.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert deltas == final.output_text == whole.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert client.responses.retrieve(final.id).output_text == final.output_text  # stored when done


def test_a_function_call_and_its_output_round_trip(client, model):
    called = client.responses.create(model=model, input=ASK, tools=[WEATHER], temperature=0.0,
                                     tool_choice={"type": "function", "name": "get_weather"})
    (call,) = called.output
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    with client.responses.stream(model=model, input=ASK, tools=[WEATHER], tool_choice="required",
                                 parallel_tool_calls=False) as stream:
        arguments = "".join(e.delta for e in stream if e.type == "response.function_call_arguments.delta")
        final = stream.get_final_response()
    (streamed,) = final.output
    assert streamed.arguments == arguments and streamed.type == "function_call"
    answered = client.responses.create(
        model=model, tools=[WEATHER], max_output_tokens=30, temperature=0.0,
        input=[{"role": "user", "content": ASK}, call.model_dump(exclude_none=True),
               {"type": "function_call_output", "call_id": call.call_id, "output": "18 degrees and sunny"}])
    assert answered.output_text and answered.status in ("completed", "incomplete")
    assert answered.usage.input_tokens > called.usage.input_tokens  # the call and its output were read


def test_text_format_through_the_sdks_parse(client, model):
    class City(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=20)
        country: str = pydantic.Field(max_length=20)

    parsed = client.responses.parse(model=model, input="Describe Lisbon as JSON.", text_format=City,
                                    max_output_tokens=60)
    assert parsed.status == "completed" and isinstance(parsed.output_parsed, City)


def test_previous_response_id_continues_the_conversation(client, model):
    first = client.responses.create(model=model, input="My name is Ada.", max_output_tokens=16, temperature=0.0)
    second = client.responses.create(model=model, input="What is my name?", previous_response_id=first.id,
                                     max_output_tokens=16, temperature=0.0)
    alone = client.responses.create(model=model, input="What is my name?", max_output_tokens=16,
                                    temperature=0.0, store=False)
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens > alone.usage.input_tokens + first.usage.output_tokens
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(alone.id)  # store=False keeps nothing
    assert client.responses.retrieve(second.id).output_text == second.output_text
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=model, input="Again?", previous_response_id=first.id)
    assert caught.value.body["param"] == "previous_response_id"


async def test_a_background_response_runs_on_and_cancel_aborts_it(protocol_server, model):
    url = protocol_server.url
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0,
                                  _strict_response_validation=True) as client, httpx2.AsyncClient() as http:
        short = await client.responses.create(model=model, input="Hi", max_output_tokens=8, background=True)
        assert short.status == "in_progress"

        async def done() -> bool:
            return (await client.responses.retrieve(short.id)).status != "in_progress"

        with trio.fail_after(30):
            await await_condition(done)
        short = await client.responses.retrieve(short.id)
        assert short.status in ("completed", "incomplete") and short.usage.output_tokens <= 8
        long = await client.responses.create(model=model, input="Write a story.", max_output_tokens=900,
                                             background=True, extra_body={"ignore_eos": True})
        with trio.fail_after(20):
            await await_condition(lambda: _running(http, url))
        cancelled = await client.responses.cancel(long.id)
        assert cancelled.status == "cancelled"
        with trio.fail_after(20):
            await await_condition(lambda: _idle(http, url))
        assert (await client.responses.retrieve(long.id)).status == "cancelled"
        with pytest.raises(openai.BadRequestError):  # only background responses can be cancelled
            await client.responses.cancel((await client.responses.create(model=model, input="Hi",
                                                                          max_output_tokens=2)).id)


async def _running(http, url) -> bool:
    return await ametric(http, url, "vllm:num_requests_running") > 0


async def _idle(http, url) -> bool:
    return await ametric(http, url, "vllm:num_requests_running") == 0


def test_an_agent_with_a_function_tool_runs_to_completion(protocol_server, model):
    import agents

    calls: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        calls.append(city)
        return f"18 degrees and sunny in {city}"

    async def run() -> agents.RunResult:
        async with openai.AsyncOpenAI(base_url=f"{protocol_server.url}/v1", api_key="unused",
                                      max_retries=0) as client:
            agent = agents.Agent(  # the Agents SDK's default model class: the Responses API
                name="weather", instructions="Answer with the tool's result.", tools=[get_weather],
                model=agents.OpenAIResponsesModel(model=model, openai_client=client),
                model_settings=agents.ModelSettings(tool_choice="required", parallel_tool_calls=False,
                                                    temperature=0.0, max_tokens=60))
            return await agents.Runner.run(agent, ASK, max_turns=4,
                                           run_config=agents.RunConfig(tracing_disabled=True))

    result = asyncio.run(run())  # the Agents SDK runs on asyncio
    kinds = [type(item).__name__ for item in result.new_items]
    assert kinds == ["ToolCallItem", "ToolCallOutputItem", "MessageOutputItem"], kinds
    assert len(calls) == 1 and calls[0]
    assert isinstance(result.final_output, str) and result.final_output


def openai_error(response: httpx2.Response, status: int, param: str | None, says: str) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param, error
    assert says in error["message"], error


def test_errors_in_openais_shape(protocol_server, model):
    url = f"{protocol_server.url}/v1/responses"
    openai_error(httpx2.post(url, json={"model": model, "input": [{"type": "computer_call"}]}), 400,
                 "input[0].type", "computer_call")
    openai_error(httpx2.post(url, json={"model": model, "input": [
        {"type": "function_call_output", "call_id": "call_9", "output": "x"}]}), 400, "input[0].call_id", "call_9")
    openai_error(httpx2.post(url, json={"model": model, "input": "x", "previous_response_id": "resp_gone"}), 400,
                 "previous_response_id", "resp_gone")
    openai_error(httpx2.post(url, json={"model": model, "input": "x", "text": {"format": {
        "type": "json_schema", "name": "x", "schema": {"type": "objekt"}}}}), 400, "text.format.schema", "")
    openai_error(httpx2.post(url, json={"model": model, "input": "word " * 2000}), 400, "input", "maximum length")
    # metadata and user are echoed back, so they are held to OpenAI's types and limits
    openai_error(httpx2.post(url, json={"model": model, "input": "x", "metadata": 5}), 400, "metadata", "object")
    openai_error(httpx2.post(url, json={"model": model, "input": "x", "metadata": {"a": 1}}), 400, "metadata", "'a'")
    openai_error(httpx2.post(url, json={"model": model, "input": "x", "metadata": {str(i): "v" for i in range(17)}}),
                 400, "metadata", "16 pairs")
    openai_error(httpx2.post(url, json={"model": model, "input": "x", "user": 5}), 400, "user", "string")
    openai_error(httpx2.post(url, json={"model": "gpt-5", "input": "x"}), 404, "model", "gpt-5")
    openai_error(httpx2.get(f"{url}/resp_gone"), 404, None, "resp_gone")
    openai_error(httpx2.delete(f"{url}/resp_gone"), 404, None, "resp_gone")


def test_a_stream_echoes_a_lone_surrogate_as_json_escapes_it(protocol_server, model):
    """metadata and user come back as sent, and a lone surrogate has no UTF-8 form: streamed,
    it ended the stream with an internal error (the whole response carried it already)."""
    body = json.dumps({"model": model, "input": "Hi", "max_output_tokens": 2, "stream": True, "store": False,
                       "metadata": {"k": "\ud800"}, "user": "\udc80"})
    with httpx2.stream("POST", f"{protocol_server.url}/v1/responses", content=body, timeout=60,
                       headers={"Content-Type": "application/json"}) as response:
        assert response.status_code == 200
        events = [json.loads(line.removeprefix("data: ")) for line in response.iter_lines() if line.startswith("data: ")]
    assert len(events) >= 3 and events[-1]["type"] == "response.incomplete", events[-1]  # its 2 tokens ran out
    assert events[-1]["response"]["metadata"] == {"k": "\ud800"} and events[-1]["response"]["user"] == "\udc80"
