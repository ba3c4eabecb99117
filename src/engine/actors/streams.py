"""Per-request output streams that never block the engine.

The output actor ``put``s without waiting; when the consumer falls behind, delta outputs
are joined into one and cumulative ones replaced by the newest, so a slow consumer holds at
most one pending output and never delays the engine or other requests.

A stream is one request's way back to its consumer. It travels with the request's messages,
and the consumer's two signals ride on it: ``closed`` (it went away: nothing more to compute)
and ``abort_requested`` (``AsyncLLM.abort``: finish now, with a final "abort" output), which
the scheduler reads when the request reaches it."""

from __future__ import annotations

import trio

from triode.engine.outputs import EmbeddingRequestOutput, RequestOutput
from triode.engine.sampling_params import OutputKind

Output = RequestOutput | EmbeddingRequestOutput


class RequestStream:
    def __init__(self, request_id: str, output_kind: OutputKind) -> None:
        self.request_id = request_id
        self._delta = output_kind == OutputKind.DELTA
        self._pending: Output | None = None
        self._error: BaseException | None = None
        self._wakeup = trio.Event()
        self.finished = False  # the final output (or an error) has been put
        self.closed = False  # the consumer went away
        self.abort_requested = False

    def put(self, output: Output) -> None:
        if self.closed or self.finished:
            return
        pending = self._pending
        if isinstance(pending, RequestOutput) and isinstance(output, RequestOutput) and self._delta:
            output = pending.followed_by(output)
        self._pending = output
        self.finished = output.finished
        self._wakeup.set()

    def end(self) -> None:
        """Ends the stream without a last output (an aborted pooling request has none)."""
        if not (self.closed or self.finished):
            self.finished = True
            self._wakeup.set()

    def fail(self, error: BaseException) -> None:
        if self.closed or self.finished:
            return
        self._error = error
        self.finished = True
        self._wakeup.set()

    async def get(self) -> Output | None:
        """The next (possibly coalesced) output; None after the final one."""
        while self._pending is None:
            if self._error is not None:
                raise self._error
            if self.finished:
                return None
            await self._wakeup.wait()
            self._wakeup = trio.Event()
        output, self._pending = self._pending, None
        return output
