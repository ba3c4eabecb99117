"""What a request's output must match: vLLM's ``StructuredOutputsParams``, one constraint per
request (a JSON schema, any JSON object, a regular expression, a choice among strings, or a
Lark grammar), checked for shape here, compiled and bounded in time before anything is
scheduled (``triode.engine.structured.compiler``), and enforced token by token in the worker
(``triode.engine.worker.grammar``).

The class is plain data, so it travels inside ``SamplingParams`` to the worker; both
processes turn it into the same llguidance grammar with ``grammar_source``. llguidance is
the grammar library (see docs/serving.md for the measurements behind the choice); it does
not import torch, so the engine process can compile with it too."""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from triode.engine import json_nesting
from triode.engine.errors import InvalidRequestError

_KINDS = ("json", "regex", "choice", "grammar", "json_object")
FIELD = "structured_outputs"


def _fail(name: str, message: str) -> None:
    raise InvalidRequestError(f"{FIELD}.{name}: {message}", field=f"{FIELD}.{name}")


def _schema(value: str | Mapping[str, Any] | bool | None) -> str | Mapping[str, Any] | bool | None:
    # A JSON string is parsed here so that the error names the field, not the backend.
    if isinstance(value, str):
        try:
            parsed: str | Mapping[str, Any] | bool | None = json_nesting.loads(value)
            return parsed
        except json.JSONDecodeError as error:
            _fail("json", f"is not valid JSON ({error.msg} at line {error.lineno} column {error.colno})")
    return value


def _choices(value: Sequence[str] | None) -> tuple[str, ...] | None:
    if value is None:
        return None
    if not isinstance(value, list | tuple) or not all(isinstance(item, str) for item in value):
        _fail("choice", "must be a list of strings")
    return tuple(value)


@attrs.frozen(kw_only=True)
class StructuredOutputsParams:
    """Exactly one of ``json`` (a JSON schema, as a dict or a JSON string), ``json_object``
    (any JSON object), ``regex``, ``choice`` (one of these strings, verbatim) or ``grammar``
    (Lark syntax, as llguidance reads it). ``disable_any_whitespace`` makes JSON compact
    (no whitespace between tokens), as in vLLM. ``disable_additional_properties`` True reads
    every object of a schema that leaves ``additionalProperties`` unset as if it said
    ``false``, and False as if it said ``true``. Unset (None), an object that declares
    ``properties`` admits no other keys, as vLLM's default backend (xgrammar) reads schemas,
    while an object schema without ``properties`` stays open: a small model given a closed
    four-field schema then closes the object instead of inventing keys until its length runs
    out. ``json_object`` is never closed."""

    # hash=False: a schema is a dict; equal params still hash equal without it
    json: str | Mapping[str, Any] | bool | None = attrs.field(default=None, converter=_schema, hash=False)
    regex: str | None = None
    choice: tuple[str, ...] | None = attrs.field(default=None, converter=_choices)
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool | None = None

    def __attrs_post_init__(self) -> None:
        given = [kind for kind in _KINDS if getattr(self, kind) not in (None, False)]
        if len(given) != 1:
            which = ", ".join(given) if given else "none"
            raise InvalidRequestError(
                f"{FIELD}: exactly one of {', '.join(_KINDS)} must be set (got {which})", field=FIELD
            )
        if self.json is not None and not isinstance(self.json, Mapping | bool):
            _fail("json", f"must be a JSON schema object, got {type(self.json).__name__}")
        if json_nesting.too_deep(self.json):
            _fail("json", f"is nested more than {json_nesting.MAX_DEPTH} levels deep")
        if self.regex is not None and not (isinstance(self.regex, str) and self.regex):
            _fail("regex", "must be a non-empty string")
        if self.grammar is not None and not (isinstance(self.grammar, str) and self.grammar.strip()):
            _fail("grammar", "must be a non-empty string")
        if self.choice is not None and (not self.choice or any(not c for c in self.choice)):
            _fail("choice", "must list at least one non-empty string")
        for name in ("json_object", "disable_any_whitespace", "disable_additional_properties"):
            value = getattr(self, name)
            if not isinstance(value, bool) and (value is not None or name == "disable_any_whitespace"):
                _fail(name, f"must be true or false, got {value!r}")

    @property
    def kind(self) -> str:
        return next(kind for kind in _KINDS if getattr(self, kind) not in (None, False))

    def source_text(self) -> str:
        """The constraint itself as text: the schema or the choices as JSON (key order kept:
        it is output order), the regex or grammar as given, nothing for any JSON object."""
        value: Any = getattr(self, self.kind)
        if self.kind == "json":
            return json.dumps(value, separators=(",", ":"))
        if self.kind == "choice":
            return json.dumps(list(value))
        return "" if self.kind == "json_object" else value

    def cache_key(self) -> str:
        """The constraint's source in one canonical string: equal keys compile to one grammar."""
        return f"{self.kind}:{int(self.disable_any_whitespace)}{self.closed_objects}:{self.source_text()}"

    @property
    def closed_objects(self) -> str:
        """Which object schemas without ``additionalProperties`` admit no other keys: "all",
        "declared" (those with ``properties``) or "none"."""
        if self.kind == "json_object" or self.disable_additional_properties is False:
            return "none"
        return "all" if self.disable_additional_properties else "declared"


_SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")
_VALUES = ("enum", "const", "default", "examples")


def _closed_objects(schema: Any, which: str) -> Any:
    """``schema`` with ``additionalProperties: false`` on the object schemas that leave it
    unset: every one (``which`` "all"), or those that declare ``properties`` ("declared")."""
    if isinstance(schema, list):
        return [_closed_objects(item, which) for item in schema]
    if not isinstance(schema, Mapping):
        return schema
    closed: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _SCHEMA_MAPS and isinstance(value, Mapping):
            closed[key] = {name: _closed_objects(sub, which) for name, sub in value.items()}
        else:
            closed[key] = value if key in _VALUES else _closed_objects(value, which)
    is_object = "properties" in closed or (which == "all" and closed.get("type") == "object")
    if is_object and "additionalProperties" not in closed:
        closed["additionalProperties"] = False
    return closed


@functools.lru_cache(maxsize=256)
def _source(kind: str, value: str, compact: bool, closed: str) -> str:
    from llguidance import LLMatcher

    if kind == "regex":
        return LLMatcher.grammar_from_regex(value)
    if kind == "grammar":
        return LLMatcher.grammar_from_lark(value)
    if kind == "choice":
        return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in json.loads(value)))
    schema: Any = {"type": "object"} if kind == "json_object" else json.loads(value)
    if closed != "none":
        schema = _closed_objects(schema, closed)
    options: Any = {"whitespace_flexible": False} if compact else None  # llguidance's JsonCompileOptions
    return LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=options)


def grammar_source(params: StructuredOutputsParams, reasoning_parser: str | None = None) -> str:
    """The llguidance grammar for ``params``, cached by the constraint's source; with a
    reasoning parser, the constraint holds after the thinking. A JSON schema that llguidance
    cannot read raises ``ValueError`` here."""
    source = _source(params.kind, params.source_text(), params.disable_any_whitespace, params.closed_objects)
    if reasoning_parser is None:
        return source
    from triode.engine.structured.reasoning import after_reasoning

    return after_reasoning(reasoning_parser, source)
