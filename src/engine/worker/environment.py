"""The first thing a worker process does: take the environment its engine had.

Workers fork from multiprocessing's forkserver (:mod:`triode.engine.actors.worker_spawn`),
which was started once, with the environment of that moment. A worker must still see what
its own engine saw when it opened, as a spawned process would: a test's or a user's
``TRIODE_CPU_ISA``, ``CUDA_VISIBLE_DEVICES`` or ``HF_HOME`` set since. trio-parallel calls
:func:`adopt` in the new process before any job, so before any of triode's modules (some
read their variables when imported) is imported there. This module imports nothing heavy
for that reason.
"""

from __future__ import annotations

import os
from collections.abc import Mapping


def adopt(environment: Mapping[str, str]) -> None:
    """Makes this process's environment ``environment``, for Python and for C libraries
    (``os.environ`` sets and unsets the variables through to the C runtime)."""
    for name in set(os.environ) - set(environment):
        del os.environ[name]
    for name, value in environment.items():
        if os.environ.get(name) != value:
            os.environ[name] = value
