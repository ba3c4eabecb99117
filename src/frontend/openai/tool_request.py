"""A chat request's tools: ``tools``, ``tool_choice`` and ``parallel_tool_calls`` read into a
``ToolPlan`` that says how the output becomes ``tool_calls``.

- ``"none"``: the tools are shown to the template, the output is text.
- ``"auto"`` (OpenAI's default when tools are given): the model decides, and the server's
  ``--tool-call-parser`` finds the calls in its text; as in vLLM this needs
  ``--enable-auto-tool-choice``, and is a 400 without it.
- ``"required"`` and a named function: enforced with structured outputs, as vLLM does: the
  output is constrained to a JSON array of ``{"name", "parameters"}`` objects built from the
  tools' parameter schemas (one object of the named function's parameters), so the calls
  always parse and their arguments validate, whatever the model and whatever the parser."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import attrs

from triode.engine import json_nesting
from triode.engine.chat_options import checked_tools
from triode.engine.errors import InvalidRequestError
from triode.engine.structured.params import StructuredOutputsParams
from triode.frontend.openai.errors import bad_request, from_engine_error
from triode.frontend.openai.request_body import Reader
from triode.frontend.openai.tool_parsers import ToolCall
from triode.frontend.openai.tool_parsers.base import new_call_id

_MODES = ("none", "auto", "required")


@attrs.frozen(kw_only=True)
class ToolPlan:
    mode: str  # none | auto | required | named
    tools: tuple[dict[str, Any], ...]  # for the chat template: OpenAI's {"type", "function"}
    named: str | None = None
    parallel: bool = True
    parser: str | None = None  # auto: the --tool-call-parser

    def constraint(self) -> StructuredOutputsParams | None:
        """The JSON schema that enforces ``required`` or a named function; a 400 naming the
        request's field where the engine refuses it (parameters nested too deep)."""
        try:
            return self._constraint()
        except InvalidRequestError as error:
            raise from_engine_error(error, self.constraint_names()) from None

    def _constraint(self) -> StructuredOutputsParams | None:
        by_name = {t["function"]["name"]: t["function"] for t in self.tools}
        if self.mode == "named":
            return StructuredOutputsParams(json=_parameters(by_name[self.named]))
        if self.mode != "required":
            return None
        calls = [{"type": "object", "properties": {"name": {"const": name},
                                                   "parameters": _parameters(function)},
                  "required": ["name", "parameters"], "additionalProperties": False}
                 for name, function in by_name.items()]
        array: dict[str, Any] = {"type": "array", "minItems": 1,
                                 "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
        if not self.parallel:
            array["maxItems"] = 1
        return StructuredOutputsParams(json=array)

    def constraint_names(self) -> dict[str, str]:
        """What the request calls the parts of :meth:`constraint`, for its errors: the named
        function's parameters, or the tools whose parameters ``required`` joins."""
        if self.mode == "named":
            index = next(i for i, tool in enumerate(self.tools) if tool["function"]["name"] == self.named)
            schema = f"tools[{index}].function.parameters"
        else:
            schema = "tools"
        return {"structured_outputs.json": schema, "structured_outputs": "tool_choice"}

    def forced_calls(self, text: str) -> list[ToolCall] | None:
        """The calls in a ``required`` or named output (None if it was cut short)."""
        try:
            value = json_nesting.loads(text)
        except json.JSONDecodeError:
            return None
        if self.mode == "named":
            return [ToolCall(id=new_call_id(), name=self.named, arguments=json.dumps(value, ensure_ascii=False))]
        return [ToolCall(id=new_call_id(), name=item["name"],
                         arguments=json.dumps(item["parameters"], ensure_ascii=False)) for item in value]


def _parameters(function: Mapping[str, Any]) -> dict[str, Any]:
    return dict(function.get("parameters") or {"type": "object", "properties": {}})


def read_tools(reader: Reader, *, parser: str | None, auto_enabled: bool) -> ToolPlan | None:
    raw = reader.raw("tools")
    choice = reader.raw("tool_choice")
    parallel = reader.bool("parallel_tool_calls", True)
    if raw is None or raw == []:
        if choice not in (None, "none"):
            raise bad_request("tool_choice: needs tools", param="tool_choice")
        return None
    if not isinstance(raw, list):
        raise reader.fail("tools", "expected an array of function tools")
    try:
        tools = checked_tools(raw)
    except InvalidRequestError as error:
        raise from_engine_error(error) from None
    names = [t["function"]["name"] for t in tools]
    mode, named = ("auto" if choice is None else choice), None
    if isinstance(choice, dict):
        function = choice.get("function")
        if choice.get("type") != "function" or not isinstance(function, dict) or not isinstance(
                function.get("name"), str):
            raise bad_request('tool_choice: expected "none", "auto", "required" or '
                              '{"type": "function", "function": {"name": ...}}', param="tool_choice")
        if function["name"] not in names:
            raise bad_request(f"tool_choice.function.name: {function['name']!r} is not one of the tools "
                              f"({', '.join(names)})", param="tool_choice.function.name")
        mode, named = "named", function["name"]
    elif mode not in _MODES:
        raise bad_request(f'tool_choice: expected "none", "auto", "required" or a named function, '
                          f"got {choice!r}", param="tool_choice")
    if mode == "auto" and not (auto_enabled and parser):
        raise bad_request('tool_choice: "auto" needs the server to run with --enable-auto-tool-choice and '
                          '--tool-call-parser (or send "required", a named function, or "none")',
                          param="tool_choice")
    return ToolPlan(mode=mode, tools=tools, named=named, parallel=parallel, parser=parser)
