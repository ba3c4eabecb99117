"""``--kv-events-config``: vLLM's KVEventsConfig, the same JSON fields and defaults."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from triode.engine.errors import InvalidRequestError
from triode.engine.json_options import from_json_object

PUBLISHERS = ("null", "zmq")
_FIELD = "kv_events_config"


def _check(message: str) -> InvalidRequestError:
    return InvalidRequestError(f"{_FIELD}: {message}", field=_FIELD)


@attrs.frozen(kw_only=True)
class KVEventsConfig:
    """Where the prefix cache's events are published. ``publisher`` None means "zmq" when
    ``enable_kv_cache_events`` is set, else "null" (no socket, no events), as in vLLM. An
    ``endpoint`` with ``*`` or ``::`` in it, or an ``ipc://`` / ``inproc://`` one, is bound;
    any other is connected to (a subscriber that binds). ``replay_endpoint`` (always bound)
    serves the last ``buffer_steps`` batches to a subscriber that missed some; ``hwm`` bounds
    what the PUB socket queues per subscriber (past it the subscriber misses batches, which
    the replay socket still has); ``max_queue_size`` bounds what waits for the publisher's
    thread (past it batches are dropped outright, counted and logged, as vLLM does)."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    def __attrs_post_init__(self) -> None:
        if self.publisher is not None and self.publisher not in PUBLISHERS:
            raise _check(f"publisher must be one of {', '.join(PUBLISHERS)}; got {self.publisher!r}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise _check(f"{name} must be a positive integer, got {value!r}")
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or "://" not in value):
                raise _check(f"{name} must be a ZMQ address such as tcp://*:5557, got {value!r}")

    @property
    def publishes(self) -> bool:
        """Whether events leave the engine at all."""
        kind = self.publisher or ("zmq" if self.enable_kv_cache_events else "null")
        return self.enable_kv_cache_events and kind == "zmq"


def kv_events_config(value: KVEventsConfig | Mapping[str, Any] | str | None) -> KVEventsConfig | None:
    """EngineArgs' converter: a KVEventsConfig from itself, a mapping or vLLM's JSON text."""
    return from_json_object(KVEventsConfig, value, _FIELD)
