"""How worker processes start: from triode's code only, never from the user's main module, and
with the environment their threads need (``WORKER_ENVIRONMENT``), in contexts that live as long
as the group (``open_worker_context``).

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

Workers fork from multiprocessing's forkserver rather than start a fresh interpreter: it
imports torch once (about 2 s on these 2-core VMs, most of a tiny model's start), and every
worker after the first, the restart after a crash included, forks from it with torch
already imported. The forkserver starts with the first worker, from the environment of that
moment, and the C libraries torch loads there (libgomp) read their variables then, so
``WORKER_ENVIRONMENT`` is set before it starts; each worker then adopts the environment its
engine had when it opened (:mod:`triode.engine.worker.environment`), as a spawned process
would inherit it. ``TRIODE_WORKER_MULTIPROC_METHOD=spawn`` starts every worker from a fresh
interpreter instead, for a program that changes libgomp's variables between engines.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
import multiprocessing
import os
from collections.abc import AsyncIterator, Callable, Iterator
from multiprocessing import spawn
from typing import Any

import trio_parallel

from triode.engine.errors import InvalidRequestError
from triode.engine.worker.environment import adopt

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


# The forkserver and every worker inherit this (torch's libgomp reads it when torch loads). By
# default an OpenMP thread spins about 300k times at every barrier before it sleeps; when the
# worker shares its cores with the server, the engine, a client or another rank, the spinning
# thread burns the time slice the thread it waits for needs. Measured on 2 cores, 64 decodes
# per step: quiet, 302 ms default, 275 ms at 2000 spins, 340 ms passive (no spinning); with
# one core kept busy by another process, 1216 ms default, 640 ms at 2000 spins, 520 passive.
# 2000 spins kept the quiet speed and halved the loss when shared. With today's faster steps
# (Zen 5, 2026-12-05, docs/benchmarks.md) OpenMP's default is about 4% faster offline and
# faster served on a quiet machine, and takes 1.67x as long with a core busy elsewhere, which
# 20000 or 50000 spins do not help: 2000 stays. A user's setting wins (a dedicated server
# can start with GOMP_SPINCOUNT=300000).
WORKER_ENVIRONMENT = {"GOMP_SPINCOUNT": "2000"}
MULTIPROC_METHODS = ("forkserver", "spawn")
# What the forkserver imports once for every worker: torch, then its objects frozen. triode's
# model and kernel modules read their variables (TRIODE_CPU_ISA, TRIODE_KERNELS) when
# imported, so each worker imports them after it has adopted its engine's environment.
FORKSERVER_PRELOAD = ("torch", "triode.engine.worker.forkserver_freeze")


@contextlib.asynccontextmanager
async def open_worker_context() -> AsyncIterator[trio_parallel.WorkerContext]:
    """A trio-parallel context whose one process (a rank) lives until the context closes."""
    for name, value in WORKER_ENVIRONMENT.items():
        os.environ.setdefault(name, value)
    method = worker_multiproc_method()
    if method == "forkserver":
        # Read when the process's forkserver starts (it replaces a preload list the program set
        # before); a forkserver the program started already keeps its own, and its workers
        # then import torch themselves.
        multiprocessing.get_context("forkserver").set_forkserver_preload(list(FORKSERVER_PRELOAD))
    init = functools.partial(adopt, dict(os.environ))
    # On the way out a context reports a worker that was killed (by a fault, or by us after
    # a failed step) as BrokenWorkerError; at shutdown that is not an error.
    with contextlib.suppress(trio_parallel.BrokenWorkerError):
        async with trio_parallel.open_worker_context(idle_timeout=math.inf, grace_period=5.0, init=init,
                                                     worker_type=trio_parallel.WorkerType(method)) as context:
            yield context


def worker_multiproc_method() -> str:
    """``TRIODE_WORKER_MULTIPROC_METHOD``: "forkserver" (the default) or "spawn"."""
    method = os.environ.get("TRIODE_WORKER_MULTIPROC_METHOD") or "forkserver"
    if method not in MULTIPROC_METHODS:
        raise InvalidRequestError(f"TRIODE_WORKER_MULTIPROC_METHOD must be one of {', '.join(MULTIPROC_METHODS)}; "
                                  f"got {method!r}", field="TRIODE_WORKER_MULTIPROC_METHOD")
    return method
