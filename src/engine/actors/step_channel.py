"""The engine's end of a worker's step channel (triode.engine.worker.step_server has the other end).

Each rank's worker, once loaded, connects to a Unix socket the engine listens on, in a private
directory, and proves itself with a token the engine gave it through trio-parallel's own pipe.
Plans then go out as soon as the driver has made them (``send``, which never waits: it writes
what the socket takes at once, and leaves the rest to a writer task behind a bounded buffer;
waking that task for every plan cost the engine's trio thread more than the write), replies
come back in the same order (a reader task), so the worker finds step N+1 waiting when it
finishes N. ``StepChannel.run`` returns when the worker closes its end (it died); the worker
group then fails what is pending with the reason it learns from trio-parallel (the exit code).
"""

from __future__ import annotations

import collections
import contextlib
import hmac
import os
import pickle
import secrets
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

import trio

from triode.engine.worker_messages import STEP_FRAME as FRAME
from triode.engine.worker_messages import StepPlan, StepResult

# At most this many plans are out on one channel: a driver keeps one or two steps out.
MAX_PLANS_OUT = 4
TOKEN_BYTES = 16

__all__ = ["MAX_PLANS_OUT", "PendingStep", "StepChannel", "StepRaised", "accept_worker", "encode_plan",
           "new_token", "open_listener"]


class StepRaised(Exception):
    """The worker's step raised ``remote_type``; the message is the worker's."""

    def __init__(self, remote_type: str, message: str) -> None:
        super().__init__(message)
        self.remote_type = remote_type


class PendingStep:
    """One plan's reply on one channel, once it is in (``done``)."""

    def __init__(self) -> None:
        self.done = trio.Event()
        self.result: StepResult | None = None
        self.error: BaseException | None = None

    def _settle(self, *, result: StepResult | None = None, error: BaseException | None = None) -> None:
        if not self.done.is_set():
            self.result, self.error = result, error
            self.done.set()


class StepChannel:
    def __init__(self, stream: trio.SocketStream) -> None:
        self._stream = stream
        self._outgoing, self._to_write = trio.open_memory_channel[bytes](MAX_PLANS_OUT)
        self._waiting: collections.deque[PendingStep] = collections.deque()
        self._closed: BaseException | None = None
        self._queued = 0  # frames handed to the writer task and not yet written
        self.decode_seconds = 0.0  # unpickling results
        self._closing = False

    def send(self, plan: StepPlan) -> PendingStep:
        """Queues the plan (in call order) and returns where its reply will be."""
        return self.send_frame(encode_plan(plan))

    def send_frame(self, frame: bytes) -> PendingStep:
        """``send`` of a plan already encoded (``encode_plan``: once for every rank)."""
        pending = PendingStep()
        if self._closed is not None:
            pending._settle(error=self._closed)
            return pending
        if len(self._waiting) >= MAX_PLANS_OUT:
            raise RuntimeError(f"more than {MAX_PLANS_OUT} plans out on one worker")
        if not self._queued and not self._closing:
            frame = frame[self._write_now(frame):]
        if frame:
            self._outgoing.send_nowait(frame)  # room for every plan out: never WouldBlock
            self._queued += 1
        self._waiting.append(pending)
        return pending

    def _write_now(self, frame: bytes) -> int:
        """How much of ``frame`` the socket took without waiting (the writer task sends the
        rest, in order). A broken socket takes nothing: the writer meets the error, and the
        reader the end of the stream, which fails the plans."""
        try:
            return os.write(self._stream.socket.fileno(), frame)
        except OSError:  # BlockingIOError (a full buffer) included
            return 0

    def close(self) -> None:
        """No more plans: the writer sends what is queued, then ends the stream's sending side,
        and the worker's loop ends once it has answered them."""
        self._closing = True
        self._outgoing.close()

    def fail_pending(self, error: BaseException) -> None:
        """Fails every plan without a reply, and every later ``send``, with ``error``."""
        self._closed = self._closed or error
        while self._waiting:
            self._waiting.popleft()._settle(error=error)

    async def run(self) -> None:
        """Writes and reads until the worker closes its end (or the stream breaks), then
        closes the stream."""
        async with self._stream, trio.open_nursery() as nursery:
            nursery.start_soon(self._write_until_broken)
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError, ConnectionError):
                await self._read()
            nursery.cancel_scope.cancel()

    async def _write_until_broken(self) -> None:
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            await self._write()

    async def _write(self) -> None:
        async for frame in self._to_write:
            await self._stream.send_all(frame)
            self._queued -= 1
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            await self._stream.send_eof()

    async def _read(self) -> None:
        buffer = bytearray()
        while True:
            while len(buffer) >= FRAME.size and len(buffer) >= FRAME.size + FRAME.unpack_from(buffer)[0]:
                size = FRAME.unpack_from(buffer)[0]
                started = time.perf_counter()
                ok, value = pickle.loads(bytes(buffer[FRAME.size:FRAME.size + size]))
                self.decode_seconds += time.perf_counter() - started
                del buffer[:FRAME.size + size]
                if not self._waiting:
                    raise ConnectionError("the worker replied to a plan it was not sent")
                pending = self._waiting.popleft()
                if ok:
                    pending._settle(result=value)
                else:
                    pending._settle(error=StepRaised(*value))
            data = await self._stream.receive_some(1 << 16)
            if not data:
                return
            buffer += data


def encode_plan(plan: StepPlan) -> bytes:
    """The frame that carries ``plan``: its length, then its pickle."""
    data = pickle.dumps(plan, protocol=pickle.HIGHEST_PROTOCOL)
    return FRAME.pack(len(data)) + data


@contextlib.asynccontextmanager
async def open_listener() -> AsyncIterator[tuple[str, trio.socket.SocketType]]:
    """A Unix socket listening in a directory only this user can enter: (address, socket)."""
    with tempfile.TemporaryDirectory(prefix="triode-steps-") as directory:  # mode 0o700
        address = str(Path(directory) / "steps")
        listener = trio.socket.socket(trio.socket.AF_UNIX, trio.socket.SOCK_STREAM)
        with listener:
            await listener.bind(address)
            listener.listen(1)
            yield address, listener


def new_token() -> bytes:
    return secrets.token_bytes(TOKEN_BYTES)


async def accept_worker(listener: trio.socket.SocketType, token: bytes) -> trio.SocketStream:
    """The connection that presents ``token`` (others are closed and ignored)."""
    while True:
        sock, _ = await listener.accept()
        stream = trio.SocketStream(sock)
        presented = b""
        with trio.move_on_after(10):
            while len(presented) < len(token) and (data := await stream.receive_some(len(token) - len(presented))):
                presented += data
        if hmac.compare_digest(presented, token):
            return stream
        await stream.aclose()
