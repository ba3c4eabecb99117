"""HTTP tests: structured outputs through the real openai SDK (strict response validation on)
against one ``triode serve`` on the default model: ``chat.completions.parse`` with a pydantic
model, json_schema and json_object at temperature 0 and 1 (with n, logprobs, stop strings and
max_tokens), vLLM's ``structured_outputs``
(choice, regex, grammar) on chat and completions, streamed and not, and the 400s that bad
constraints get before anything is scheduled."""

from __future__ import annotations

import json
import re
from typing import Literal

import jsonschema
import openai
import pydantic
import pytest

from tests.http_server import metric

pytestmark = [pytest.mark.default_model]

ASK_PERSON = [{"role": "user", "content": "Invent a person and describe them as JSON."}]
PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "languages": {"type": "array", "items": {"enum": ["en", "fr", "de"]}, "maxItems": 3},
    },
    "required": ["name", "age", "languages"],
    "additionalProperties": False,
}


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=20)
    country: str = pydantic.Field(max_length=20)
    population_millions: int = pydantic.Field(ge=0, le=40)  # a float's digits can run on


class Trip(pydantic.BaseModel):
    city: City
    days: int
    season: Literal["spring", "summer", "autumn", "winter"]


@pytest.fixture(scope="module")
def server(protocol_server):
    return protocol_server


@pytest.fixture(scope="module")
def client(protocol_client):
    return protocol_client


def model(client) -> str:
    return client.models.list().data[0].id


def json_schema_format(schema: dict, name: str = "person") -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def test_parse_returns_the_pydantic_object(client):
    completion = client.chat.completions.parse(
        model=model(client), max_completion_tokens=120, temperature=0.0, response_format=Trip,
        messages=[{"role": "user", "content": "Plan a trip to a city as JSON."}],
    )
    message = completion.choices[0].message
    assert completion.choices[0].finish_reason == "stop"
    assert isinstance(message.parsed, Trip) and message.refusal is None
    assert Trip.model_validate_json(message.content) == message.parsed


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_and_json_object_outputs_validate(client, temperature):
    completion = client.chat.completions.create(
        model=model(client), messages=ASK_PERSON, max_completion_tokens=120, temperature=temperature,
        seed=3, n=2, response_format=json_schema_format(PERSON_SCHEMA),
    )
    assert len(completion.choices) == 2
    for choice in completion.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), PERSON_SCHEMA)
    # Free-form JSON from a 135M model at temperature 1 wanders (1 run in 5 or so runs past
    # 200 tokens, unconstrained or not); top_p 0.8 keeps it on the question.
    completion = client.chat.completions.create(
        model=model(client), max_completion_tokens=200, temperature=temperature, top_p=0.8, seed=5, n=3,
        messages=[{"role": "user", "content": "Give me a JSON object with the keys a and b."}],
        response_format={"type": "json_object"},
    )
    assert len(completion.choices) == 3
    for choice in completion.choices:
        assert choice.finish_reason == "stop"
        assert isinstance(json.loads(choice.message.content), dict)


def test_a_streamed_constrained_chat_equals_the_whole_one_and_logprobs_come_along(client):
    request = dict(model=model(client), messages=ASK_PERSON, max_completion_tokens=120, temperature=0.0,
                   response_format=json_schema_format(PERSON_SCHEMA), logprobs=True, top_logprobs=2)
    whole = client.chat.completions.create(**request).choices[0]
    chunks = list(client.chat.completions.create(**request, stream=True))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    tokens = whole.logprobs.content
    assert "".join(t.token for t in tokens) == whole.message.content + "<|im_end|>"  # EOS too, as vLLM
    assert all(t.logprob >= -9999.0 and len(t.top_logprobs) == 2 for t in tokens)


def test_a_constrained_output_cut_by_max_tokens_says_length(client):
    completion = client.chat.completions.create(
        model=model(client), messages=ASK_PERSON, max_completion_tokens=6, temperature=0.0,
        response_format=json_schema_format(PERSON_SCHEMA),
    )
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage.completion_tokens == 6


def test_a_stop_string_ends_a_constrained_output(client):
    completion = client.chat.completions.create(
        model=model(client), messages=ASK_PERSON, max_completion_tokens=120, temperature=0.0,
        response_format=json_schema_format(PERSON_SCHEMA), stop=['"age"'],
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "stop" and choice.model_extra["stop_reason"] == '"age"'
    assert choice.message.content.startswith("{") and '"age"' not in choice.message.content


def test_choice_regex_and_grammar_hold_on_chat_and_completions(server, client):
    # The SDK's strict mode rejects every streamed completion chunk (its Completion type has no
    # null finish_reason, which OpenAI itself sends mid-stream), so that stream is read loosely.
    loose = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    answers = ["red", "green", "blue"]
    cases = [({"choice": answers}, lambda text: text in answers),
             ({"regex": r"[0-9]{2}:[0-9]{2}"}, lambda text: re.fullmatch(r"[0-9]{2}:[0-9]{2}", text)),
             ({"grammar": 'start: "ok" | "fine"'}, lambda text: text in ("ok", "fine"))]
    for constraint, holds in cases:
        chat = client.chat.completions.create(
            model=model(client), max_completion_tokens=20, temperature=1.0, seed=1,
            messages=[{"role": "user", "content": "What is your favourite colour, and what time is it?"}],
            extra_body={"structured_outputs": constraint},
        )
        completion = client.completions.create(
            model=model(client), prompt=["The sky is", "It is now"], max_tokens=20, temperature=1.0,
            seed=1, extra_body={"structured_outputs": constraint},
        )
        stream = loose.completions.create(
            model=model(client), prompt="Right now", max_tokens=20, temperature=0.0, stream=True,
            extra_body={"structured_outputs": constraint},
        )
        streamed = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
        texts = [chat.choices[0].message.content, *(c.text for c in completion.choices), streamed]
        assert all(holds(text) for text in texts), (constraint, texts)
    loose.close()


def test_response_format_on_completions_and_vllm_guided_fields(client):
    completion = client.completions.create(
        model=model(client), prompt="A person as JSON:", max_tokens=120, temperature=0.0,
        extra_body={"response_format": json_schema_format(PERSON_SCHEMA)},
    )
    jsonschema.validate(json.loads(completion.choices[0].text), PERSON_SCHEMA)
    completion = client.completions.create(
        model=model(client), prompt="Yes or no?", max_tokens=5, temperature=0.0,
        extra_body={"guided_choice": ["yes", "no"]},
    )
    assert completion.choices[0].text in ("yes", "no")


@pytest.mark.parametrize("extra, param, message", [
    ({"response_format": json_schema_format({"type": "objekt"})},
     "response_format.json_schema.schema", "is not a valid JSON Schema at type"),
    ({"response_format": json_schema_format({"type": "array", "uniqueItems": True})},
     "response_format.json_schema.schema", "Unimplemented keys"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": PERSON_SCHEMA}}},
     "response_format.json_schema.name", "is required"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "expected text, json_object or json_schema"),
    ({"structured_outputs": {"regex": "([a-"}}, "structured_outputs.regex", "invalid regular expression"),
    ({"structured_outputs": {"grammar": "start: nothing"}}, "structured_outputs.grammar", "unknown name"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "at least one"),
    ({"structured_outputs": {"choice": ["a"], "regex": "a"}}, "structured_outputs", "exactly one of"),
    ({"structured_outputs": {"json_schema": {}}}, "structured_outputs.json_schema", "unknown field"),
    ({"structured_outputs": {"choice": ["a"]}, "response_format": {"type": "json_object"}},
     "structured_outputs", "cannot be combined with response_format"),
    ({"guided_regex": "[z-a]"}, "guided_regex", "invalid regular expression"),
])
def test_bad_constraints_get_a_400_naming_the_parameter(server, client, extra, param, message):
    before = metric(server.url, "vllm:prefix_cache_queries_total")
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=model(client), messages=ASK_PERSON, max_completion_tokens=5,
                                       extra_body=extra)
    error = caught.value.body
    assert error["param"] == param and message in error["message"], error
    assert error["type"] == "invalid_request_error"
    assert metric(server.url, "vllm:prefix_cache_queries_total") == before  # nothing was scheduled


def test_a_schema_that_leaves_additional_properties_unset_is_closed_as_vllm_does(client):
    # What pydantic and most hand-written schemas give: properties, and no additionalProperties.
    # Left open, the default model writes these four and then invents keys until the length runs
    # out ("official_country_name_type", ...); vLLM's default backend closes the object.
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "country": {"type": "string"},
                                               "population": {"type": "integer"}, "language": {"type": "string"}},
              "required": ["name", "country", "population", "language"]}
    completion = client.chat.completions.create(
        model=model(client), temperature=0, max_tokens=120,
        messages=[{"role": "user", "content": "Describe Lisbon as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema}},
    )
    assert len(completion.choices) == 1
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"  # the object closed: no keys invented to the length limit
    assert set(json.loads(choice.message.content)) == {"name", "country", "population", "language"}
