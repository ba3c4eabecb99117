"""What every tool-call parser shares: the parsed shapes, the streamed deltas, and the rule
that makes streaming safe. A parser is sans-IO and per choice: ``feed`` takes each new piece
of the output text and returns what may be shown now, ``finish`` flushes the rest. Text
that could still turn out to be part of a tool call is held back, and a call is released
only once it is complete and parses, so a malformed call stays text and no fragment of the
markup ever reaches ``content``. The non-streamed result is ``parse``: the same parser fed
the whole text at once, so streamed and whole outputs agree by construction."""

from __future__ import annotations

import abc
import json
import uuid
from collections.abc import Mapping
from typing import Any

import attrs

from triode.engine import json_nesting


@attrs.frozen
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object, as text (OpenAI's shape)


@attrs.frozen
class ToolCallDelta:
    """OpenAI's streamed tool call: ``id`` and ``name`` come in the first delta of an index,
    ``arguments`` fragments follow."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@attrs.frozen
class ParserDelta:
    content: str = ""
    tool_calls: tuple[ToolCallDelta, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.content or self.tool_calls)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def call_from_object(value: Any, *, arguments_keys: tuple[str, ...] = ("arguments", "parameters"),
                     call_id: str | None = None) -> ToolCall | None:
    """A ``{"name": ..., "arguments": {...}}`` object as a call, or None if it is not one.
    Arguments given as a JSON string holding an object are accepted too."""
    if not isinstance(value, Mapping) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    arguments: Any = {}
    for key in arguments_keys:
        if key in value:
            arguments = value[key]
            break
    if isinstance(arguments, str):
        try:
            arguments = json_nesting.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, Mapping):
        return None
    return ToolCall(id=call_id or new_call_id(), name=value["name"],
                    arguments=json.dumps(arguments, ensure_ascii=False))


class ToolCallParser(abc.ABC):
    """The base of every parser: keeps what was released, so that the result is the sum of
    the deltas. Subclasses implement ``_feed`` and ``_finish`` with ``_text``/``_call``."""

    name = ""
    # Parsers whose markup is a special token need it kept in the detokenized text.
    needs_special_tokens = False

    def __init__(self) -> None:
        self.content = ""
        self.tool_calls: list[ToolCall] = []
        self._pending: list[ParserDelta] = []

    def _text(self, text: str) -> None:
        if text:
            self.content += text
            self._pending.append(ParserDelta(content=text))

    def _call(self, call: ToolCall) -> None:
        index = len(self.tool_calls)
        self.tool_calls.append(call)
        self._pending.append(ParserDelta(tool_calls=(
            ToolCallDelta(index=index, id=call.id, name=call.name),
            ToolCallDelta(index=index, arguments=call.arguments),
        )))

    def _released(self) -> list[ParserDelta]:
        """What became showable, in order; adjacent text joined."""
        released: list[ParserDelta] = []
        for delta in self._pending:
            if delta.content and released and released[-1].content and not released[-1].tool_calls:
                released[-1] = ParserDelta(content=released[-1].content + delta.content)
            else:
                released.append(delta)
        self._pending = []
        return released

    def feed(self, text: str) -> list[ParserDelta]:
        self._feed(text)
        return self._released()

    def finish(self) -> list[ParserDelta]:
        self._finish()
        return self._released()

    @abc.abstractmethod
    def _feed(self, text: str) -> None: ...

    @abc.abstractmethod
    def _finish(self) -> None: ...


def parse(parser: ToolCallParser, text: str) -> tuple[str, list[ToolCall]]:
    """The whole output at once: (content outside the calls, the calls)."""
    parser.feed(text)
    parser.finish()
    return parser.content, parser.tool_calls
