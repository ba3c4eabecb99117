"""Server-sent events, in the three framings the APIs use:

- chat and completions: ``data: {json}`` per chunk and ``data: [DONE]`` at the end;
- Responses and Messages: ``event: <type>`` before each ``data: {json}`` (the event's own
  ``type``), and no end marker.

An error after the stream started cannot change the HTTP status any more: it is sent as an
``event: error`` whose data is the API's error object (the SDKs raise it), then the stream
ends (after ``[DONE]`` where the framing has one). Cancellation (the client left) and
generator closing pass through untouched."""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

from triode.frontend.openai.errors import APIError, from_engine_error

DONE = b"data: [DONE]\n\n"
CONTENT_TYPE = "text/event-stream; charset=utf-8"
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def encode(data: dict[str, Any], *, event: str | None = None) -> bytes:
    prefix = f"event: {event}\n" if event else ""
    try:
        return f"{prefix}data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n".encode()
    except UnicodeEncodeError:
        # A lone surrogate (metadata echoed as the client sent it, a tool call's arguments as
        # the model escaped them) has no UTF-8 form: JSON's own escapes carry it.
        return f"{prefix}data: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


async def event_stream(chunks: AsyncGenerator[dict[str, Any], None], *, typed: bool = False,
                       error_body: Callable[[APIError], dict[str, Any]] = APIError.body,
                       ) -> AsyncIterator[bytes]:
    """``typed``: name each event by its data's ``type`` and send no ``[DONE]``."""
    try:
        try:
            async for chunk in chunks:
                yield encode(chunk, event=chunk["type"] if typed else None)
        except Exception as error:
            failed = from_engine_error(error)
        else:
            failed = None
    finally:
        await chunks.aclose()
    if failed is not None:
        yield encode(error_body(failed), event="error")
    if not typed:
        yield DONE
