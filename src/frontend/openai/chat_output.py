"""One chat choice's text turned into OpenAI's assistant message: reasoning split off first
(``--reasoning-parser``), then tool calls found in the answer (``--tool-call-parser`` for
``tool_choice: "auto"``, the enforced JSON for ``"required"`` and a named function), the rest
being ``content``. Sans-IO and per choice: ``feed`` takes each new piece of text and returns
the message deltas that may be shown now, ``finish`` the rest; the whole message is the
same machine fed the whole text."""

from __future__ import annotations

from typing import Any

import attrs

from triode.engine.structured.reasoning import REASONING_PARSERS, ReasoningDelta, ReasoningParser
from triode.frontend.openai.tool_parsers import (
    TOOL_PARSERS,
    ParserDelta,
    ToolCall,
    ToolCallDelta,
    ToolCallParser,
)
from triode.frontend.openai.tool_request import ToolPlan


@attrs.frozen
class MessageDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: tuple[ToolCallDelta, ...] = ()

    def as_delta(self) -> dict[str, Any]:
        delta: dict[str, Any] = {}
        if self.reasoning:
            delta["reasoning"] = delta["reasoning_content"] = self.reasoning
        if self.content:
            delta["content"] = self.content
        if self.tool_calls:
            delta["tool_calls"] = [_call_delta(c) for c in self.tool_calls]
        return delta


def _call_delta(call: ToolCallDelta) -> dict[str, Any]:
    function: dict[str, Any] = {"arguments": call.arguments}
    entry: dict[str, Any] = {"index": call.index, "function": function}
    if call.id is not None:
        entry.update(id=call.id, type="function")
        function["name"] = call.name
    return entry


class ChatOutput:
    def __init__(self, *, reasoning_parser: str | None = None, tools: ToolPlan | None = None) -> None:
        self._reasoning: ReasoningParser | None = (
            REASONING_PARSERS[reasoning_parser]() if reasoning_parser else None)
        self._tools = tools
        self._parser: ToolCallParser | None = (
            TOOL_PARSERS[tools.parser]() if tools is not None and tools.mode == "auto" else None)
        self._forced = tools is not None and tools.mode in ("required", "named")
        self._forced_text = ""
        self.reasoning = ""
        self.content = ""
        self.tool_calls: list[ToolCall] = []

    def feed(self, text: str) -> list[MessageDelta]:
        return self._answer(self._reasoning.feed(text) if self._reasoning else [ReasoningDelta(content=text)], finish=False)

    def finish(self) -> list[MessageDelta]:
        return self._answer(self._reasoning.finish() if self._reasoning else [], finish=True)

    def _answer(self, pieces: list[ReasoningDelta], *, finish: bool) -> list[MessageDelta]:
        out: list[MessageDelta] = []
        for piece in pieces:
            if piece.reasoning:
                self.reasoning += piece.reasoning
                out.append(MessageDelta(reasoning=piece.reasoning))
            if piece.content:
                out.extend(self._content(piece.content))
        if finish:
            out.extend(self._finish_content())
        return out

    def _content(self, text: str) -> list[MessageDelta]:
        if self._forced:
            self._forced_text += text  # released whole, as calls, when the output ends
            return []
        if self._parser is None:
            self.content += text
            return [MessageDelta(content=text)]
        return [self._released(d) for d in self._parser.feed(text)]

    def _finish_content(self) -> list[MessageDelta]:
        if self._parser is not None:
            return [self._released(d) for d in self._parser.finish()]
        if not self._forced:
            return []
        calls = self._tools.forced_calls(self._forced_text)
        if calls is None:  # cut short by max_tokens: what there is stays text
            self.content += self._forced_text
            return [MessageDelta(content=self._forced_text)] if self._forced_text else []
        deltas = []
        for index, call in enumerate(calls):
            self.tool_calls.append(call)
            deltas.append(MessageDelta(tool_calls=(ToolCallDelta(index=index, id=call.id, name=call.name),
                                                   ToolCallDelta(index=index, arguments=call.arguments))))
        return deltas

    def _released(self, delta: ParserDelta) -> MessageDelta:
        self.content += delta.content
        for call in delta.tool_calls:
            if call.id is not None:
                self.tool_calls.append(ToolCall(id=call.id, name=call.name, arguments=""))
            else:
                last = self.tool_calls[call.index]
                self.tool_calls[call.index] = attrs.evolve(last, arguments=last.arguments + call.arguments)
        return MessageDelta(content=delta.content, tool_calls=delta.tool_calls)

    def message(self) -> dict[str, Any]:
        """The whole assistant message (after ``finish``)."""
        message: dict[str, Any] = {"role": "assistant", "content": self.content or None, "refusal": None}
        if self.content == "" and not self.tool_calls:
            message["content"] = ""
        if self.tool_calls:
            message["tool_calls"] = [{"id": c.id, "type": "function",
                                      "function": {"name": c.name, "arguments": c.arguments}}
                                     for c in self.tool_calls]
        if self._reasoning is not None:
            message["reasoning"] = message["reasoning_content"] = self.reasoning or None
        return message

    def finish_reason(self, engine_reason: str | None) -> str | None:
        return "tool_calls" if self.tool_calls and engine_reason == "stop" else engine_reason
