"""Worker processes that start from triode's code only, never from the user's main module.

multiprocessing's spawn start method (trio-parallel's default) tells each child to re-run
the parent's ``__main__`` first, by path for a script and by name under ``python -m``, so
that functions defined there can be unpickled. triode's workers only ever run triode's own
functions, and re-running the user's code in them is what breaks the scripts people write:
a script without an ``if __name__ == "__main__":`` guard builds a second ``LLM`` inside the
worker (which dies), ``python - < script.py`` makes the child look for a file named
``<stdin>``, and a module run with ``-m`` runs twice.

So while a triode task starts a worker, the preparation data multiprocessing sends the child
leaves the main module out. The choice is made per task (a context variable, which
``trio.to_thread`` carries into the thread where trio-parallel starts the process): the
user's own multiprocessing, and trio-parallel's default context, are untouched.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from multiprocessing import spawn
from typing import Any

_MAIN_MODULE_KEYS = ("init_main_from_name", "init_main_from_path")
_starting_engine_worker = contextvars.ContextVar("triode_starting_engine_worker", default=False)


def _without_main_module(original: Callable[[str], dict[str, Any]]) -> Callable[[str], dict[str, Any]]:
    def get_preparation_data(name: str) -> dict[str, Any]:
        data = original(name)
        if _starting_engine_worker.get():
            for key in _MAIN_MODULE_KEYS:
                data.pop(key, None)
        return data

    get_preparation_data.triode_original = original  # type: ignore[attr-defined]
    return get_preparation_data


def _install() -> None:
    # Both spawn and forkserver Popen look the function up on the module at each start.
    if not hasattr(spawn.get_preparation_data, "triode_original"):
        spawn.get_preparation_data = _without_main_module(spawn.get_preparation_data)  # type: ignore[assignment]


@contextlib.contextmanager
def starting_engine_workers() -> Iterator[None]:
    """Worker processes started by this task (and the threads it hands work to) inside the
    block skip the user's main module."""
    _install()
    token = _starting_engine_worker.set(True)
    try:
        yield
    finally:
        _starting_engine_worker.reset(token)
