"""The responses a server keeps for ``previous_response_id``, ``GET /v1/responses/{id}`` and
cancel: in memory, bounded in number (the oldest go first) and in age (an entry older than
``max_age`` seconds is gone on the next look), both set by ``--responses-store-size`` and
``--responses-store-max-age``; a background response still running is kept past both. Each entry holds the response object and the conversation
that led to it, as Responses items (its input, its history, its output), so a follow-up
continues it; a background response also holds what cancels it."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import attrs


@attrs.define
class StoredResponse:
    response: dict[str, Any]
    items: tuple[dict[str, Any], ...]  # the conversation: history, input, then output
    stored_at: float
    cancel: Callable[[], None] | None = None  # a background response still running


@attrs.frozen
class StoreStatistics:
    stored: int
    max_size: int
    max_age: float
    evicted: int
    expired: int


class ResponseStore:
    def __init__(self, *, max_size: int, max_age: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_size = max_size
        self.max_age = max_age
        self._clock = clock
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._evicted = 0
        self._expired = 0

    def put(self, response: dict[str, Any], items: tuple[dict[str, Any], ...], *,
            cancel: Callable[[], None] | None = None) -> None:
        """Stores (or replaces) a response under its ``id``; a size of 0 stores nothing."""
        self._expire()
        if self.max_size == 0:
            return
        self._entries.pop(response["id"], None)
        self._entries[response["id"]] = StoredResponse(response, items, self._clock(), cancel)
        while len(self._entries) > self.max_size and (oldest := self._oldest_done()) is not None:
            del self._entries[oldest]
            self._evicted += 1

    def get(self, response_id: str) -> StoredResponse | None:
        self._expire()
        return self._entries.get(response_id)

    def delete(self, response_id: str) -> bool:
        self._expire()
        return self._entries.pop(response_id, None) is not None

    def _oldest_done(self, before: float | None = None) -> str | None:
        """The oldest entry (stored before ``before``) that is not a background response
        still running: those stay, or nothing could cancel them."""
        for response_id, entry in self._entries.items():
            if before is not None and entry.stored_at > before:
                return None
            if entry.cancel is None or entry.response.get("status") != "in_progress":
                return response_id
        return None

    def _expire(self) -> None:
        while (oldest := self._oldest_done(before=self._clock() - self.max_age)) is not None:
            del self._entries[oldest]
            self._expired += 1

    def statistics(self) -> StoreStatistics:
        return StoreStatistics(stored=len(self._entries), max_size=self.max_size, max_age=self.max_age,
                               evicted=self._evicted, expired=self._expired)
