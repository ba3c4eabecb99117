"""The ZMQ publisher of KV-cache events, in vLLM's wire format.

Each batch the engine core hands over (one per step that changed the cache) becomes one
message of three frames on a PUB socket: the topic, a sequence number (8 bytes, big-endian,
from 0 for each publisher), and a msgpack ``EventBatch``: ``[ts, [event, ...], 0]`` (the wall
time, the events, the data-parallel rank), each event a map tagged by ``"type"``:

- ``{"type": "BlockStored", "block_hashes", "parent_block_hash", "token_ids", "block_size",
  "lora_id", "medium", "lora_name"}``
- ``{"type": "BlockRemoved", "block_hashes", "medium"}``
- ``{"type": "AllBlocksCleared"}``

A block hash goes out as vLLM sends it by default: an unsigned 64-bit integer, the digest's
last 8 bytes read big-endian (triode's own digest: consumers use hashes as opaque ids and key
their index by the blocks' token ids). ``medium`` is ``"GPU"``, vLLM's name for the engine's
own KV cache whatever the device (its CPU build says the same).

A replay ROUTER socket answers a request carrying a start sequence number (``[b"", seq]``
from a REQ or DEALER socket) with every buffered batch from there as ``[topic, seq,
payload]``, then ``[topic, -1, b""]``.

The sockets live in one thread of their own: ``publish`` encodes the batch on the caller's
thread and hands it over on an inproc pipe without waiting; a full pipe (``max_queue_size``
batches the thread has not sent: the engine outrunning it) drops the batch outright, counted
in ``dropped`` and logged. A PUB socket never blocks on a slow or gone subscriber either: past
``hwm`` it drops messages for that subscriber, who sees the gap in the sequence numbers and
can ask the replay socket for them."""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Iterator

import msgpack
import zmq

from triode.engine.core.kv_cache_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
)
from triode.engine.errors import TriodeError
from triode.engine.kv_events.config import KVEventsConfig

log = logging.getLogger(__name__)
MEDIUM = "GPU"
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)


class KVEventsBindError(TriodeError):
    """An endpoint could not be bound (or connected to): the message names it."""


def external_hash(digest: bytes) -> int:
    """A block hash as vLLM sends it by default: the digest's last 8 bytes, big-endian."""
    return int.from_bytes(digest[-8:], "big")


def encode_event(event: KVCacheEvent) -> dict[str, object]:
    match event:
        case BlockStored():
            return {"type": "BlockStored", "block_hashes": [external_hash(h) for h in event.block_hashes],
                    "parent_block_hash": None if event.parent_block_hash is None
                    else external_hash(event.parent_block_hash),
                    "token_ids": list(event.token_ids), "block_size": event.block_size,
                    "lora_id": event.lora_id, "medium": MEDIUM, "lora_name": event.lora_name}
        case BlockRemoved():
            return {"type": "BlockRemoved", "block_hashes": [external_hash(h) for h in event.block_hashes],
                    "medium": MEDIUM}
        case AllBlocksCleared():
            return {"type": "AllBlocksCleared"}
    raise TypeError(f"not a KV-cache event: {event!r}")


def encode_batch(events: list[KVCacheEvent], ts: float) -> bytes:
    return msgpack.packb([ts, [encode_event(e) for e in events], 0])


def _attach(socket: zmq.Socket, endpoint: str) -> None:
    """Binds or connects as vLLM does: an address with a wildcard, or a local one, is bound."""
    try:
        if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
            socket.bind(endpoint)
        else:
            socket.connect(endpoint)
    except zmq.ZMQError as error:
        raise KVEventsBindError(f"kv_events_config: cannot bind or connect {endpoint}: {error}") from None


class ZmqEventPublisher:
    def __init__(self, config: KVEventsConfig) -> None:
        self.config = config
        self.dropped = 0  # batches the pipe to the publisher's thread had no room for
        self.published = 0  # batches sent on the PUB socket
        self._context = zmq.Context()
        self._pipe_address = f"inproc://kv-events-{id(self)}"
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._serve, name="triode-kv-events", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            self._thread.join()
            self._context.term()
            raise self._error
        self._pipe = self._context.socket(zmq.PAIR)  # used by the publishing thread only
        self._pipe.set_hwm(config.max_queue_size)
        self._pipe.connect(self._pipe_address)

    def publish(self, events: list[KVCacheEvent]) -> None:
        """Queues one batch for the PUB socket; never waits (a full queue drops it)."""
        try:
            self._pipe.send(encode_batch(events, time.time()), zmq.NOBLOCK)
        except zmq.Again:
            if not self.dropped:
                log.warning("kv_events: the publisher's queue is full (max_queue_size=%d): dropping batches",
                            self.config.max_queue_size)
            self.dropped += 1

    def close(self) -> None:
        """Sends what is queued, then closes the sockets; idempotent."""
        if self._pipe.closed:
            return
        # An empty batch ends the thread's loop. A full pipe drains fast (a PUB socket never
        # waits), so the end waits for room, but not for ever.
        self._pipe.setsockopt(zmq.SNDTIMEO, 5000)
        with contextlib.suppress(zmq.Again):
            self._pipe.send(b"")
        self._thread.join(timeout=5.0)  # the pipe stays open until the thread has read the end
        self._pipe.close(linger=0)
        if not self._thread.is_alive():  # else its sockets are open: terminating would hang
            self._context.term()

    def _serve(self) -> None:
        config = self.config
        sockets = []
        try:
            pipe = self._context.socket(zmq.PAIR)
            sockets.append(pipe)
            pipe.bind(self._pipe_address)
            pub = self._context.socket(zmq.PUB)
            sockets.append(pub)
            pub.set_hwm(config.hwm)
            _attach(pub, config.endpoint)
            replay = None
            if config.replay_endpoint is not None:
                replay = self._context.socket(zmq.ROUTER)
                sockets.append(replay)
                _attach(replay, config.replay_endpoint)
        except BaseException as error:
            self._error = error
            for socket in sockets:
                socket.close(linger=0)
            self._ready.set()
            return
        self._ready.set()
        try:
            self._loop(pipe, pub, replay)
        finally:
            for socket in sockets:
                socket.close(linger=1000)  # a moment for the last batches to leave

    def _loop(self, pipe: zmq.Socket, pub: zmq.Socket, replay: zmq.Socket | None) -> None:
        topic = self.config.topic.encode()
        buffer: collections.deque[tuple[bytes, bytes]] = collections.deque(maxlen=self.config.buffer_steps)
        numbers = itertools.count()
        poller = zmq.Poller()
        poller.register(pipe, zmq.POLLIN)
        if replay is not None:
            poller.register(replay, zmq.POLLIN)
        while True:
            ready = dict(poller.poll())
            if pipe in ready:
                payload = pipe.recv()
                if not payload:
                    return
                seq = next(numbers).to_bytes(8, "big")
                buffer.append((seq, payload))
                pub.send_multipart((topic, seq, payload))
                self.published += 1
            if replay is not None and replay in ready:
                self._replay(replay, topic, buffer)

    @staticmethod
    def _replay(replay: zmq.Socket, topic: bytes, buffer: collections.deque[tuple[bytes, bytes]]) -> None:
        frames = replay.recv_multipart()
        # [identity, b"", start] from a REQ or DEALER that sends the empty delimiter, else [identity, start]
        envelope, start = frames[:-1], frames[-1]
        if len(start) != 8 or len(envelope) not in (1, 2):
            return  # not a replay request: ignored, as vLLM does
        first = int.from_bytes(start, "big")
        for seq, payload in list(buffer):
            if int.from_bytes(seq, "big") >= first:
                replay.send_multipart((*envelope, topic, seq, payload))
        replay.send_multipart((*envelope, topic, END_OF_REPLAY, b""))


def start_kv_event_publisher(config: KVEventsConfig | None) -> ZmqEventPublisher | None:
    """The publisher ``config`` asks for, started (None when it publishes nothing); the caller
    closes it. An endpoint that cannot be bound raises ``KVEventsBindError`` naming it."""
    return ZmqEventPublisher(config) if config is not None and config.publishes else None


@contextlib.contextmanager
def open_kv_event_publisher(config: KVEventsConfig | None) -> Iterator[ZmqEventPublisher | None]:
    """``start_kv_event_publisher``, closed on exit."""
    publisher = start_kv_event_publisher(config)
    try:
        yield publisher
    finally:
        if publisher is not None:
            publisher.close()
