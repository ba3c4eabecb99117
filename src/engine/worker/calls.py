"""The worker processes' entry points, as references the engine process can send without
importing them: ``triode.engine.worker.process`` imports torch and the model code, which the engine
process never needs. A ``WorkerCall`` pickles by name (trio-parallel pickles every call) and
imports its target when it runs, in the worker."""

from __future__ import annotations

import importlib
from typing import Any

import attrs


@attrs.frozen
class WorkerCall:
    function: str  # a function of triode.engine.worker.process

    def __call__(self, *args: Any) -> Any:
        return getattr(importlib.import_module("triode.engine.worker.process"), self.function)(*args)


LOAD = WorkerCall("load")
SERVE_STEPS = WorkerCall("serve_steps")
SERVE_RENDEZVOUS = WorkerCall("serve_rendezvous")
