"""A trio event loop in a background thread, for the sync entry layers.

LLMEngine and LLM drive the sans-IO core from the caller's thread; the worker-supervisor
actor (worker processes, watchdog, restarts) needs trio, so it lives in this loop and the
caller reaches it with ``call``."""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import trio

T = TypeVar("T")


class TrioThread:
    """Starts ``actor.run`` in a nursery on a private trio loop; ``close`` cancels it."""

    def __init__(self, actor_run: Callable[..., Awaitable[Any]], *, name: str = "triode-trio") -> None:
        self._actor_run = actor_run
        self._ready = threading.Event()
        self._token: trio.lowlevel.TrioToken | None = None
        self._cancel_scope: trio.CancelScope | None = None
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
            self._cancel_scope = nursery.cancel_scope
            self.handle = await nursery.start(self._actor_run)
            self._ready.set()

    def call(self, async_fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        if self._token is None or not self._thread.is_alive():
            raise RuntimeError("the engine's trio thread is not running")
        return trio.from_thread.run(async_fn, *args, trio_token=self._token)

    def close(self) -> None:
        if self._thread.is_alive() and self._token is not None:
            try:
                trio.from_thread.run_sync(self._cancel_scope.cancel, trio_token=self._token)
            except trio.RunFinishedError:
                pass
        self._thread.join()


def _unwrap(error: BaseException) -> BaseException:
    """A single error out of nested exception groups, so the caller sees the typed error."""
    while isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:
        error = error.exceptions[0]
    return error
