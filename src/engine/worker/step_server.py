"""The worker's end of the step channel: plans in, results out, in plan order, over a Unix
socket that the engine listens on (triode.engine.actors.step_channel has the other end).

Why not one trio-parallel call per step: a call is a round trip (the engine sends, the worker
wakes, runs, replies, the engine wakes and only then sends the next plan), and the worker sat
idle for all of it between two steps. Here the engine sends step N+1 while N runs; it waits
in the socket's buffer, and the worker starts it the moment N is done (the tokens N sampled,
which N+1 feeds, are the worker's own: triode.engine.worker.runner). No trio: a blocking loop in the
process trio-parallel started, as the one long call it runs.

A frame is an 8-byte little-endian length and a pickle. The worker answers each plan with
``(True, StepResult)`` or, if the step raised, ``(False, (type name, message))``, and goes on
reading (the engine restarts a worker whose step failed). The engine closing its end ends the
loop. The first bytes the worker sends are the token it was given, so that no other process
that finds the socket can talk to the engine.
"""

from __future__ import annotations

import pickle
import socket
from collections.abc import Callable

from triode.engine.worker_messages import STEP_FRAME as FRAME
from triode.engine.worker_messages import StepPlan, StepResult

__all__ = ["serve"]


def _receive_exactly(sock: socket.socket, size: int) -> bytes | None:
    """``size`` bytes, or None if the peer closed before the first of them."""
    buffer = bytearray(size)
    view, received = memoryview(buffer), 0
    while received < size:
        count = sock.recv_into(view[received:])
        if count == 0:
            if received == 0:
                return None
            raise ConnectionError(f"the engine closed the step channel {received} bytes into a frame")
        received += count
    return bytes(buffer)


def _send_frame(sock: socket.socket, payload: object) -> None:
    data = pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)
    sock.sendall(FRAME.pack(len(data)) + data)


def serve(address: str, token: bytes, execute: Callable[[StepPlan], StepResult]) -> None:
    """Runs every plan the engine sends at ``address`` through ``execute``, until it closes."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(address)
        sock.sendall(token)
        while (header := _receive_exactly(sock, FRAME.size)) is not None:
            body = _receive_exactly(sock, FRAME.unpack(header)[0])
            if body is None:
                raise ConnectionError("the engine closed the step channel inside a frame")
            plan = pickle.loads(body)
            try:
                reply = (True, execute(plan))
            except Exception as error:  # reported to the engine, which restarts this worker
                reply = (False, (type(error).__name__, str(error)))
            _send_frame(sock, reply)
