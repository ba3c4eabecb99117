"""``--tool-call-parser llama3_json``: Llama 3.1-3.3's JSON tool calls. An output that is
tool calls starts with ``{`` (or ``<|python_tag|>``) and is one or more
``{"name": ..., "parameters": {...}}`` objects separated by ``;``. Anything else is text.

Whether the output is calls is known from its first visible character, so text streams at
once; calls are released when the output ends, all of them or none (a sequence that does
not parse whole stays text)."""

from __future__ import annotations

import json

from triode.engine import json_nesting
from triode.frontend.openai.tool_parsers.base import ToolCall, ToolCallParser, call_from_object

PYTHON_TAG = "<|python_tag|>"


def split_calls(text: str, separator: str = ";") -> list[ToolCall] | None:
    """``{...}; {...}`` as calls, or None unless the whole text is such objects."""
    decoder = json.JSONDecoder()
    calls, position = [], 0
    while True:
        while position < len(text) and text[position].isspace():
            position += 1
        try:
            value, position = decoder.raw_decode(text, position)
        except (json.JSONDecodeError, RecursionError):
            return None
        if json_nesting.too_deep(value):
            return None
        call = call_from_object(value)
        if call is None:
            return None
        calls.append(call)
        rest = text[position:].lstrip()
        if not rest:
            return calls
        if not rest.startswith(separator):
            return None
        position = len(text) - len(rest) + len(separator)


class Llama3JsonToolParser(ToolCallParser):
    name = "llama3_json"
    needs_special_tokens = True  # <|python_tag|> is a special token

    def __init__(self) -> None:
        super().__init__()
        self._buffer = ""
        self._calls: bool | None = None  # unknown until the first visible character

    def _feed(self, text: str) -> None:
        if self._calls is False:
            self._text(text)
            return
        self._buffer += text
        head = self._buffer.lstrip()
        if self._calls is None and head:
            if head.startswith("{") or head.startswith(PYTHON_TAG):
                self._calls = True
            elif not PYTHON_TAG.startswith(head):
                self._calls = False
                self._text(self._buffer)
                self._buffer = ""

    def _finish(self) -> None:
        body = self._buffer.strip().removeprefix(PYTHON_TAG)
        calls = split_calls(body) if self._calls else None
        if calls:
            for call in calls:
                self._call(call)
        else:
            self._text(self._buffer)
        self._buffer = ""
