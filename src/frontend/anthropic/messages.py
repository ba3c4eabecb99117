"""Engine outputs shaped into Anthropic's message, whole or as its event stream:
``message_start``; per content block (``thinking``, ``text``, ``tool_use``, in the order the
output produced them) ``content_block_start``, its deltas (``thinking_delta``,
``text_delta``, ``input_json_delta``) and ``content_block_stop``; ``message_delta`` with the
``stop_reason`` and the usage; ``message_stop``.

The chat output machine (:class:`~triode.frontend.openai.chat_output.ChatOutput`) splits
reasoning and tool calls off the text exactly as for chat completions. Usage follows
Anthropic's reading: ``input_tokens`` are the prompt tokens not read from the prefix cache,
which ``cache_read_input_tokens`` counts."""

from __future__ import annotations

import json
from typing import Any

from triode.engine import json_nesting
from triode.engine.outputs import CompletionOutput, RequestOutput
from triode.frontend.openai.chat_output import ChatOutput, MessageDelta
from triode.frontend.openai.errors import APIError
from triode.frontend.openai.requests import GenerationRequest

ABORTED = "the server aborted the request before it finished (it is shutting down)"


def stop_reason(output: CompletionOutput, tool_calls: bool) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished output."""
    if output.finish_reason == "length":
        return "max_tokens", None
    if output.finish_reason != "stop":
        raise APIError(503, ABORTED, code="aborted")
    if tool_calls:
        return "tool_use", None
    if isinstance(output.stop_reason, str):
        return "stop_sequence", output.stop_reason
    return "end_turn", None


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments as the object Anthropic's ``input`` is (parsers and the enforced
    schema give JSON objects; anything else is kept under ``arguments``)."""
    try:
        value = json_nesting.loads(arguments or "{}")
    except json.JSONDecodeError:
        return {"arguments": arguments}
    return value if isinstance(value, dict) else {"arguments": value}


class MessageBuilder:
    def __init__(self, request: GenerationRequest, *, message_id: str, model: str) -> None:
        self.id = message_id
        self.model = model
        self.chat = ChatOutput(reasoning_parser=request.reasoning_parser, tools=request.tools)
        self.input_tokens = 0
        self.cached_tokens = 0
        self.output_tokens = 0
        self._block: str | None = None  # the type of the open content block
        self._text_opened = False
        self._index = -1

    def _count(self, output: RequestOutput) -> CompletionOutput:
        self.input_tokens = len(output.prompt_token_ids)
        self.cached_tokens = output.num_cached_tokens
        self.output_tokens += len(output.outputs[0].token_ids)
        return output.outputs[0]

    def usage(self) -> dict[str, Any]:
        return {"input_tokens": self.input_tokens - self.cached_tokens, "output_tokens": self.output_tokens,
                "cache_creation_input_tokens": 0, "cache_read_input_tokens": self.cached_tokens}

    def _message(self, content: list[dict[str, Any]], reason: str | None, sequence: str | None) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": reason, "stop_sequence": sequence, "usage": self.usage()}

    def full(self, final: RequestOutput) -> dict[str, Any]:
        completion = self._count(final)
        self.chat.feed(completion.text)
        self.chat.finish()
        content: list[dict[str, Any]] = []
        if self.chat.reasoning:
            content.append({"type": "thinking", "thinking": self.chat.reasoning, "signature": ""})
        if self.chat.content or not self.chat.tool_calls:
            content.append({"type": "text", "text": self.chat.content})
        content += [{"type": "tool_use", "id": call.id, "name": call.name, "input": tool_input(call.arguments)}
                    for call in self.chat.tool_calls]
        return self._message(content, *stop_reason(completion, bool(self.chat.tool_calls)))

    # -- the event stream -------------------------------------------------------------------

    def start(self, first: RequestOutput) -> list[dict[str, Any]]:
        self.input_tokens = len(first.prompt_token_ids)
        self.cached_tokens = first.num_cached_tokens
        return [{"type": "message_start", "message": self._message([], None, None)}]

    def events(self, output: RequestOutput) -> list[dict[str, Any]]:
        completion = self._count(output)
        deltas = self.chat.feed(completion.text)
        if completion.finish_reason is None:
            return self._blocks(deltas)
        events = self._blocks(deltas + self.chat.finish())
        reason, sequence = stop_reason(completion, bool(self.chat.tool_calls))
        if not self._text_opened and not self.chat.tool_calls:  # as the whole message has: an empty text
            events += self._open({"type": "text", "text": ""})
        events += self._close()
        return [*events, {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                          "usage": self.usage()},
                {"type": "message_stop"}]

    def _blocks(self, deltas: list[MessageDelta]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        for delta in deltas:
            if delta.reasoning:
                if self._block != "thinking":
                    events += self._open({"type": "thinking", "thinking": "", "signature": ""})
                events.append(self._delta({"type": "thinking_delta", "thinking": delta.reasoning}))
            if delta.content:
                if self._block != "text":
                    events += self._open({"type": "text", "text": ""})
                events.append(self._delta({"type": "text_delta", "text": delta.content}))
            for call in delta.tool_calls:
                if call.id is not None:
                    events += self._open({"type": "tool_use", "id": call.id, "name": call.name, "input": {}})
                if call.arguments:
                    events.append(self._delta({"type": "input_json_delta", "partial_json": call.arguments}))
        return events

    def _open(self, block: dict[str, Any]) -> list[dict[str, Any]]:
        events = self._close()
        self._index += 1
        self._block = block["type"]
        self._text_opened |= self._block == "text"
        return [*events, {"type": "content_block_start", "index": self._index, "content_block": block}]

    def _close(self) -> list[dict[str, Any]]:
        if self._block is None:
            return []
        self._block = None
        return [{"type": "content_block_stop", "index": self._index}]

    def _delta(self, delta: dict[str, Any]) -> dict[str, Any]:
        return {"type": "content_block_delta", "index": self._index, "delta": delta}
