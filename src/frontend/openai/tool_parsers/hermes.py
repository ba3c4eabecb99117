"""``--tool-call-parser hermes``: calls as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
(Hermes, Qwen2.5, Qwen3 and most ChatML models), any number of them, with text around them.

Outside a call, text is released as it comes, except an end that could be the start of
``<tool_call>`` and whitespace that may turn out to separate calls. Inside, the block waits
for ``</tool_call>`` (or the end of the output, where models often stop without closing)
and becomes a call if it is one JSON object with a name and object arguments; otherwise
the whole block, tags included, is text."""

from __future__ import annotations

import json

from triode.engine import json_nesting
from triode.engine.structured.streaming_text import split_at
from triode.frontend.openai.tool_parsers.base import ToolCallParser, call_from_object

START, END = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolCallParser):
    name = "hermes"

    def __init__(self) -> None:
        super().__init__()
        self._buffer = ""
        self._inside = False
        self._space = ""  # whitespace held until we know whether a call follows it

    def _feed(self, text: str) -> None:
        self._buffer += text
        while True:
            if self._inside:
                end = self._buffer.find(END)
                if end < 0:
                    return
                block, self._buffer = self._buffer[:end], self._buffer[end + len(END):]
                self._inside = False
                self._block(block, closed=True)
                continue
            released, self._buffer, self._inside = split_at(self._buffer, START)
            self._outside(released)
            if not self._inside:
                return

    def _outside(self, text: str) -> None:
        # Whitespace next to a call is the call's layout, not content; it comes back as text
        # if the call turns out malformed.
        text = self._space + text
        stripped = text.rstrip()
        self._text(stripped)
        self._space = text[len(stripped):]

    def _block(self, block: str, *, closed: bool) -> None:
        try:
            call = call_from_object(json_nesting.loads(block))
        except json.JSONDecodeError:
            call = None
        if call is not None:
            self._call(call)
        else:
            self._text(self._space + START + block + (END if closed else ""))
        self._space = ""

    def _finish(self) -> None:
        if self._inside:
            self._inside = False
            self._block(self._buffer, closed=False)
        elif self._buffer or not self.tool_calls:
            self._text(self._space + self._buffer)
        self._buffer = self._space = ""
