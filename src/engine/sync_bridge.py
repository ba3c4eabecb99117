"""A trio event loop in a background thread, for the sync entry layers.

LLMEngine and LLM drive the sans-IO core from the caller's thread; the worker-supervisor
actor (worker processes, watchdog, restarts) needs trio, so it lives in this loop and the
caller reaches it with ``submit``, which queues the call without waiting for the loop and
hands back a ``concurrent.futures.Future``: a caller interrupted while it waits
(KeyboardInterrupt) leaves the call running, and can collect its result later instead of
losing a step the workers already ran.

Python raises KeyboardInterrupt between any two bytecodes of the main thread, so the sync
engine holds it off (``deferred_keyboard_interrupt``) for the few lines that must not be cut
in half: making a plan and handing it to the loop, and applying a result. It then lands
only while the caller waits for the workers, where nothing is half-done."""

from __future__ import annotations

import _signal
import concurrent.futures
import contextlib
import signal
import threading
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

import trio

from triode.engine.errors import EngineShutdownError

T = TypeVar("T")


class TrioThread:
    """Starts ``actor.run`` in a nursery on a private trio loop; ``close`` cancels it."""

    def __init__(self, actor_run: Callable[..., Awaitable[Any]], *, name: str = "triode-trio") -> None:
        self._actor_run = actor_run
        self._ready = threading.Event()
        self._token: trio.lowlevel.TrioToken | None = None
        self._nursery: trio.Nursery | None = None
        self._error: BaseException | None = None
        self.handle: Any = None
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            self._thread.join()
            raise self._error

    def _main(self) -> None:
        try:
            trio.run(self._serve)
        except BaseException as e:  # delivered to the constructor or to close()
            self._error = _unwrap(e)
        finally:
            self._ready.set()

    async def _serve(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            self.handle = await nursery.start(self._actor_run)
            self._ready.set()

    def submit(self, begin: Callable[[], Callable[[], Awaitable[T]]]) -> concurrent.futures.Future[T]:
        """Calls ``begin()`` on the loop, in the order of the ``submit`` calls, then awaits the
        async function it returns in a task of its own; the outcome arrives in the future.
        (``begin`` runs in order and at once, where tasks would start in any order: a driver
        sends its plans there.)"""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()

        async def run(async_fn: Callable[[], Awaitable[T]]) -> None:
            try:
                result = await async_fn()
            except Exception as e:
                future.set_exception(e)
            except BaseException:  # cancelled: the loop is closing
                future.set_exception(EngineShutdownError("the engine was closed while a call ran"))
                raise
            else:
                future.set_result(result)

        def start(nursery: trio.Nursery) -> None:
            try:
                async_fn = begin()
            except Exception as e:
                future.set_exception(e)
                return
            try:
                nursery.start_soon(run, async_fn)
            except RuntimeError:  # the nursery closed after the call was queued
                future.set_exception(EngineShutdownError("the engine is closed"))

        if self._nursery is None or self._token is None or not self._thread.is_alive():
            raise EngineShutdownError("the engine is closed")
        # Queued without waiting for the loop to take it: a blocking hand-over (wake the loop,
        # wait for its reply) cost the caller 0.3-0.45 ms a step at 64 sequences on two cores.
        try:
            self._token.run_sync_soon(start, self._nursery)
        except trio.RunFinishedError:
            raise EngineShutdownError("the engine is closed") from None
        return future

    def close(self) -> None:
        """Cancels the loop (stopping the workers) and waits for it; idempotent."""
        if threading.current_thread() is self._thread:
            # A garbage collection that ran in the loop's own thread: it cannot wait for itself.
            if self._nursery is not None:
                self._nursery.cancel_scope.cancel()
            return
        if self._thread.is_alive() and self._nursery is not None:
            try:
                trio.from_thread.run_sync(self._nursery.cancel_scope.cancel, trio_token=self._token)
            except trio.RunFinishedError:
                pass
        self._thread.join()


@contextlib.contextmanager
def deferred_keyboard_interrupt() -> Iterator[None]:
    """A SIGINT that arrives inside the block is delivered (to whatever handler was there)
    when the block ends. Only the main thread receives signals; elsewhere it does nothing."""
    # _signal's functions, not signal's: those convert every handler through enums (a failed
    # lookup, an exception, for a Python function), 9 us a block against 0.4, three blocks a step.
    previous = _signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or previous is None:
        yield  # None: a handler installed outside Python, which cannot be put back
        return
    pending: list[int] = []
    _signal.signal(signal.SIGINT, lambda signum, frame: pending.append(signum))
    try:
        yield
    finally:
        _signal.signal(signal.SIGINT, previous)
        if pending:
            signal.raise_signal(signal.SIGINT)


def _unwrap(error: BaseException) -> BaseException:
    """A single error out of nested exception groups, so the caller sees the typed error."""
    while isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:
        error = error.exceptions[0]
    return error
