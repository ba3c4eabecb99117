"""Fault injection for tests and scenarios: a plan of faults the worker inflicts on itself at
given engine steps. Normal serving never sets one; it exists so that crash, hang and error
handling can be exercised through the real worker processes.

The plan is not an engine argument: a serving deployment has no business setting it. The engine
process reads it from the ``TRIODE_FAULT_PLAN`` variable of its own environment at start-up
(where ``triode scenario`` and the tests set it), refuses a malformed one, and hands it to each
worker it loads. Grammar: a comma-separated list of ``KIND@STEP`` or ``KIND@FIRST..LAST``, with
KIND one of

- ``crash``: the worker process kills itself with SIGKILL (as an OOM kill would);
- ``hang``: the step never returns (the step watchdog must fire);
- ``raise``: the step raises ``InjectedFault`` (as a bug in the model forward would).

For example ``crash@12`` or ``hang@5,crash@30..60``. Steps are the scheduler's step ids,
which keep counting across worker restarts, so each fault fires at most once per step id.
"""

from __future__ import annotations

import os
import signal
import time

import attrs

from triode.engine.errors import InvalidRequestError

KINDS = ("crash", "hang", "raise")


class InjectedFault(RuntimeError):
    """Raised by a ``raise`` fault."""


@attrs.frozen
class Fault:
    kind: str
    first_step: int
    last_step: int

    def applies_to(self, step_id: int) -> bool:
        return self.first_step <= step_id <= self.last_step


FAULT_PLAN_ENV = "TRIODE_FAULT_PLAN"


def fault_plan_from_env() -> str | None:
    """The plan ``TRIODE_FAULT_PLAN`` sets in this process's environment, checked, or None."""
    text = os.environ.get(FAULT_PLAN_ENV) or None
    parse_fault_plan(text)
    return text


def parse_fault_plan(text: str | None) -> tuple[Fault, ...]:
    if not text:
        return ()
    faults = []
    for item in text.split(","):
        kind, _, steps = item.strip().partition("@")
        first, _, last = steps.partition("..")
        try:
            fault = Fault(kind, int(first), int(last or first))
        except ValueError:
            fault = None
        if fault is None or kind not in KINDS or fault.first_step > fault.last_step or fault.first_step < 0:
            raise InvalidRequestError(
                f"{FAULT_PLAN_ENV}: {item.strip()!r} is not KIND@STEP or KIND@FIRST..LAST with KIND in "
                f"{', '.join(KINDS)}",
                field=FAULT_PLAN_ENV,
            )
        faults.append(fault)
    return tuple(faults)


def inject(faults: tuple[Fault, ...], step_id: int) -> None:
    """Inflicts the first fault planned for ``step_id``, if any."""
    for fault in faults:
        if not fault.applies_to(step_id):
            continue
        if fault.kind == "crash":
            os.kill(os.getpid(), signal.SIGKILL)
        if fault.kind == "hang":
            while True:
                time.sleep(3600)
        raise InjectedFault(f"injected fault at step {step_id}")
