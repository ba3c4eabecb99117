"""A request body's output constraint, in the shapes clients send it: OpenAI's
``response_format`` (``json_object``, or ``json_schema`` with a name, a schema and ``strict``),
vLLM's ``structured_outputs`` object (``json``, ``regex``, ``choice``, ``grammar``,
``json_object`` and its options), and vLLM's older ``guided_*`` fields, which ported clients
still send. At most one of them may constrain a request.

The result is one ``StructuredOutputsParams`` and the names the client used for its parts,
so that an error the engine finds later (a schema that does not compile) names the field
the client actually sent."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from triode.engine.errors import InvalidRequestError
from triode.engine.structured.params import FIELD, StructuredOutputsParams
from triode.frontend.openai.errors import bad_request, from_engine_error
from triode.frontend.openai.request_body import Reader

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}
_OPTIONS = {field.name for field in attrs.fields(StructuredOutputsParams)}


@attrs.frozen
class Constraint:
    params: StructuredOutputsParams | None
    # the engine's field name -> the one in the request (for errors)
    names: Mapping[str, str] = attrs.field(factory=dict)


def read_constraint(reader: Reader) -> Constraint:
    found = [c for c in (_response_format(reader), _structured_outputs(reader), _guided(reader))
             if c.params is not None]
    if len(found) > 1:
        sent = [c.names.get(FIELD, FIELD) for c in found]
        raise bad_request(f"{sent[1]}: cannot be combined with {sent[0]}; send one output constraint",
                          param=sent[1])
    return found[0] if found else Constraint(None)


def _params(fields: dict[str, Any], names: Mapping[str, str]) -> Constraint:
    try:
        return Constraint(StructuredOutputsParams(**fields), names)
    except InvalidRequestError as error:
        raise from_engine_error(error, names) from None


def _response_format(reader: Reader) -> Constraint:
    value = reader.raw("response_format")
    if value is None:
        return Constraint(None)
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise reader.fail("response_format", 'expected an object with a "type"')
    kind = value["type"]
    if kind == "text":
        return Constraint(None)
    if kind == "json_object":
        return _params({"json_object": True}, {FIELD: "response_format"})
    if kind != "json_schema":
        raise bad_request(f"response_format.type: expected text, json_object or json_schema, got {kind!r}",
                          param="response_format.type")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise bad_request("response_format.json_schema: expected an object with a name and a schema",
                          param="response_format.json_schema")
    name = spec.get("name")
    if not isinstance(name, str) or not name:
        raise bad_request("response_format.json_schema.name: is required (a non-empty string)",
                          param="response_format.json_schema.name")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise bad_request("response_format.json_schema.strict: expected a boolean",
                          param="response_format.json_schema.strict")
    schema = spec.get("schema", {"type": "object"})  # OpenAI: without a schema, any object
    if not isinstance(schema, dict):
        raise bad_request("response_format.json_schema.schema: expected a JSON Schema object",
                          param="response_format.json_schema.schema")
    return _params({"json": schema}, {FIELD: "response_format",
                                      f"{FIELD}.json": "response_format.json_schema.schema"})


def _structured_outputs(reader: Reader) -> Constraint:
    value = reader.raw(FIELD)
    if value is None:
        return Constraint(None)
    if not isinstance(value, dict):
        raise reader.fail(FIELD, "expected an object (json, regex, choice, grammar or json_object)")
    if unknown := sorted(set(value) - _OPTIONS):
        raise bad_request(f"{FIELD}.{unknown[0]}: unknown field; the fields are {', '.join(sorted(_OPTIONS))}",
                          param=f"{FIELD}.{unknown[0]}")
    return _params({name: option for name, option in value.items() if option is not None}, {})  # null: unset


def _guided(reader: Reader) -> Constraint:
    fields = {kind: reader.raw(name) for name, kind in _GUIDED.items() if reader.raw(name) is not None}
    reader.raw("guided_decoding_backend")  # accepted and ignored: llguidance is the backend
    if not fields:
        return Constraint(None)
    names = {f"{FIELD}.{kind}": name for name, kind in _GUIDED.items()}
    names[FIELD] = next(name for name, kind in _GUIDED.items() if kind in fields)
    return _params(fields, names)
