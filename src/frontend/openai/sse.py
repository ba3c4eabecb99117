"""Server-sent events: ``data: {json}`` per chunk, ``data: [DONE]`` at the end.

An error after the stream started cannot change the HTTP status any more: it is sent as an
``event: error`` whose data is OpenAI's error object (the SDK raises it as APIError), followed
by ``[DONE]``. Cancellation (the client left) and generator closing pass through untouched."""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from triode.frontend.openai.errors import from_engine_error

DONE = b"data: [DONE]\n\n"
CONTENT_TYPE = "text/event-stream; charset=utf-8"
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def encode(data: dict[str, Any], *, event: str | None = None) -> bytes:
    payload = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    prefix = f"event: {event}\n" if event else ""
    return f"{prefix}data: {payload}\n\n".encode()


async def event_stream(chunks: AsyncGenerator[dict[str, Any], None]) -> AsyncIterator[bytes]:
    try:
        try:
            async for chunk in chunks:
                yield encode(chunk)
        except Exception as error:
            failed = from_engine_error(error)
        else:
            failed = None
    finally:
        await chunks.aclose()
    if failed is not None:
        yield encode(failed.body(), event="error")
    yield DONE
