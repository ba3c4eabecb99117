"""``--tool-call-parser mistral``: Mistral's ``[TOOL_CALLS]`` special token, then either a
JSON array of ``{"name": ..., "arguments": {...}}`` (v3 tokenizers) or ``name[ARGS]{...}``
per call (v11 and later). Text before the first ``[TOOL_CALLS]`` streams as content; what
follows it is released when the output ends, as calls if it parses whole, else as text.
Call ids are 9 letters and digits, the only ids Mistral's chat templates accept back."""

from __future__ import annotations

import json
import random
import string

from triode.engine import json_nesting
from triode.engine.structured.streaming_text import split_at
from triode.frontend.openai.tool_parsers.base import ToolCall, ToolCallParser, call_from_object

MARKER, ARGS = "[TOOL_CALLS]", "[ARGS]"
_ID_CHARACTERS = string.ascii_letters + string.digits


def mistral_call_id() -> str:
    return "".join(random.choices(_ID_CHARACTERS, k=9))


def _calls(body: str) -> list[ToolCall] | None:
    if ARGS in body:
        calls = []
        for part in body.split(MARKER):
            name, found, arguments = part.partition(ARGS)
            call = call_from_object({"name": name.strip(), "arguments": arguments},
                                    call_id=mistral_call_id()) if found else None
            if call is None:
                return None
            calls.append(call)
        return calls
    try:
        value = json_nesting.loads(body)
    except json.JSONDecodeError:
        return None
    items = value if isinstance(value, list) else [value]
    calls = [call_from_object(item, call_id=mistral_call_id()) for item in items]
    return calls if calls and all(c is not None for c in calls) else None


class MistralToolParser(ToolCallParser):
    name = "mistral"
    needs_special_tokens = True

    def __init__(self) -> None:
        super().__init__()
        self._buffer = ""
        self._after_marker = False

    def _feed(self, text: str) -> None:
        self._buffer += text
        if self._after_marker:
            return
        released, self._buffer, self._after_marker = split_at(self._buffer, MARKER)
        self._text(released.rstrip() if self._after_marker else released)

    def _finish(self) -> None:
        calls = _calls(self._buffer.strip()) if self._after_marker else None
        if calls:
            for call in calls:
                self._call(call)
        else:
            self._text((MARKER if self._after_marker else "") + self._buffer)
        self._buffer = ""
