"""Engine outputs shaped into a Responses API response, whole or as its typed events.

The output items come in the order the text produced them: a ``reasoning`` item (with
``--reasoning-parser``), a ``message`` with one ``output_text`` part, a ``function_call``
per call. Streamed, each event carries a ``sequence_number``: ``response.created`` and
``response.in_progress``; per item ``response.output_item.added``, its part's
``response.content_part.added``, the deltas (``response.reasoning_text.delta``,
``response.output_text.delta``, ``response.function_call_arguments.delta``), their
``.done`` events and ``response.output_item.done``; last ``response.completed`` (or
``response.incomplete`` when ``max_output_tokens`` cut it) with the whole response."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from triode.engine.outputs import CompletionOutput, RequestOutput
from triode.frontend.openai.chat_output import ChatOutput, MessageDelta
from triode.frontend.openai.errors import APIError
from triode.frontend.openai.requests import GenerationRequest

ABORTED = "the server aborted the request before it finished (it is shutting down)"


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def reasoning_item(text: str, status: str = "completed", item_id: str | None = None) -> dict[str, Any]:
    return {"id": item_id or _id("rs"), "type": "reasoning", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}] if status != "in_progress" else [],
            "status": status}


def message_item(text: str, status: str = "completed", item_id: str | None = None) -> dict[str, Any]:
    content = [] if status == "in_progress" else [_text_part(text)]
    return {"id": item_id or _id("msg"), "type": "message", "role": "assistant", "status": status,
            "content": content}


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def call_item(call_id: str, name: str, arguments: str, status: str = "completed",
              item_id: str | None = None) -> dict[str, Any]:
    return {"id": item_id or _id("fc"), "type": "function_call", "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


class ResponseBuilder:
    def __init__(self, request: GenerationRequest, echo: Mapping[str, Any], *, response_id: str, model: str,
                 count_tokens: Callable[[str], int] = lambda text: 0) -> None:
        self.id = response_id
        self.model = model
        self.echo = echo
        self.created_at = int(time.time())
        self.chat = ChatOutput(reasoning_parser=request.reasoning_parser, tools=request.tools)
        self._count_tokens = count_tokens
        self.input_tokens = self.cached_tokens = self.output_tokens = 0
        self.items: list[dict[str, Any]] = []  # finished output items
        self._open: dict[str, Any] | None = None  # the item being streamed
        self._text = ""  # its text or arguments so far
        self._sequence = 0

    def response(self, status: str, *, error: APIError | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "model": self.model, "output": list(self.items), "error": None, "incomplete_details": None,
            "usage": None, **self.echo}
        if status == "incomplete":
            body["incomplete_details"] = {"reason": "max_output_tokens"}
        if error is not None:
            body["error"] = {"code": error.code or "server_error", "message": error.message}
        if status in ("completed", "incomplete"):
            body["completed_at"] = int(time.time())
            body["usage"] = self.usage()
        return body

    def usage(self) -> dict[str, Any]:
        return {"input_tokens": self.input_tokens,
                "input_tokens_details": {"cached_tokens": self.cached_tokens, "cache_write_tokens": 0},
                "output_tokens": self.output_tokens,
                "output_tokens_details": {"reasoning_tokens": min(self.output_tokens, self._count_tokens(
                    self.chat.reasoning)) if self.chat.reasoning else 0},
                "total_tokens": self.input_tokens + self.output_tokens}

    def _count(self, output: RequestOutput) -> CompletionOutput:
        self.input_tokens = len(output.prompt_token_ids)
        self.cached_tokens = output.num_cached_tokens
        self.output_tokens += len(output.outputs[0].token_ids)
        return output.outputs[0]

    def full(self, final: RequestOutput) -> dict[str, Any]:
        completion = self._count(final)
        self.chat.feed(completion.text)
        self.chat.finish()
        status = _status(completion)
        if self.chat.reasoning:
            self.items.append(reasoning_item(self.chat.reasoning))
        if self.chat.content or not self.chat.tool_calls:
            self.items.append(message_item(self.chat.content, status))
        self.items += [call_item(call.id, call.name, call.arguments) for call in self.chat.tool_calls]
        return self.response(status)

    # -- the event stream -------------------------------------------------------------------

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self._sequence += 1
        return {"type": kind, "sequence_number": self._sequence - 1, **fields}

    def start(self, first: RequestOutput) -> list[dict[str, Any]]:
        self.input_tokens = len(first.prompt_token_ids)
        self.cached_tokens = first.num_cached_tokens
        return [self._event("response.created", response=self.response("in_progress")),
                self._event("response.in_progress", response=self.response("in_progress"))]

    def events(self, output: RequestOutput) -> list[dict[str, Any]]:
        completion = self._count(output)
        deltas = self.chat.feed(completion.text)
        if completion.finish_reason is None:
            return self._stream(deltas)
        events = self._stream(deltas + self.chat.finish())
        status = _status(completion)
        if not any(item["type"] == "message" for item in [*self.items, self._open or {"type": ""}]) \
                and not self.chat.tool_calls:  # as the whole response has: an empty message
            events += self._open_item(message_item("", "in_progress"))
        events += self._close(status)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        return [*events, self._event(kind, response=self.response(status))]

    def error_event(self, error: APIError) -> dict[str, Any]:
        return self._event("error", code=error.code, message=error.message, param=error.param)

    def _stream(self, deltas: list[MessageDelta]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        for delta in deltas:
            if delta.reasoning:
                if self._kind() != "reasoning":
                    events += self._open_item(reasoning_item("", "in_progress"))
                events.append(self._delta("response.reasoning_text.delta", delta.reasoning))
            if delta.content:
                if self._kind() != "message":
                    events += self._open_item(message_item("", "in_progress"))
                events.append(self._delta("response.output_text.delta", delta.content, logprobs=[]))
            for call in delta.tool_calls:
                if call.id is not None:
                    events += self._open_item(call_item(call.id, call.name or "", "", "in_progress"))
                if call.arguments:
                    events.append(self._delta("response.function_call_arguments.delta", call.arguments))
        return events

    def _kind(self) -> str | None:
        return self._open["type"] if self._open is not None else None

    def _where(self) -> dict[str, Any]:
        assert self._open is not None
        return {"item_id": self._open["id"], "output_index": len(self.items)}

    def _delta(self, kind: str, text: str, **fields: Any) -> dict[str, Any]:
        self._text += text
        content = {} if kind == "response.function_call_arguments.delta" else {"content_index": 0}
        return self._event(kind, **self._where(), **content, delta=text, **fields)

    def _open_item(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        events = self._close("completed")
        self._open, self._text = item, ""
        events.append(self._event("response.output_item.added", output_index=len(self.items), item=item))
        if item["type"] == "reasoning":
            events.append(self._event("response.content_part.added", **self._where(), content_index=0,
                                      part={"type": "reasoning_text", "text": ""}))
        elif item["type"] == "message":
            events.append(self._event("response.content_part.added", **self._where(), content_index=0,
                                      part=_text_part("")))
        return events

    def _close(self, status: str) -> list[dict[str, Any]]:
        item, text = self._open, self._text
        if item is None:
            return []
        where = self._where()
        events = []
        if item["type"] == "reasoning":
            done = reasoning_item(text, item_id=item["id"])
            events += [self._event("response.reasoning_text.done", **where, content_index=0, text=text),
                       self._event("response.content_part.done", **where, content_index=0,
                                   part=done["content"][0])]
        elif item["type"] == "message":
            done = message_item(text, status, item_id=item["id"])
            events += [self._event("response.output_text.done", **where, content_index=0, text=text, logprobs=[]),
                       self._event("response.content_part.done", **where, content_index=0,
                                   part=done["content"][0])]
        else:
            done = call_item(item["call_id"], item["name"], text, item_id=item["id"])
            events.append(self._event("response.function_call_arguments.done", **where, name=item["name"],
                                      arguments=text))
        events.append(self._event("response.output_item.done", output_index=where["output_index"], item=done))
        self.items.append(done)
        self._open, self._text = None, ""
        return events


def _status(output: CompletionOutput) -> str:
    if output.finish_reason == "length":
        return "incomplete"
    if output.finish_reason != "stop":
        raise APIError(503, ABORTED, code="aborted")
    return "completed"
