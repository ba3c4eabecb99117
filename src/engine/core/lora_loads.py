"""Which LoRA adapters the workers can run now: the scheduler's side of reading adapters in the
background (sans-IO).

An adapter's files are read by a thread of each worker while steps go on. The scheduler asks
for an adapter when a sequence of it arrives (``StepPlan.load_loras``), admits its sequences
once a step's result lists it read (``StepResult.loaded_loras``), and forgets it when the
workers drop it from host memory or restart. With nothing else to run and reads pending, a
chunkless plan that waits for a read (``StepPlan.wait_for_loads``) is the only way the engine
hears of one: one such plan is out at a time."""

from __future__ import annotations

from collections.abc import Iterable

from triode.engine.lora.request import LoRARequest
from triode.engine.worker_messages import StepResult

__all__ = ["AdapterSlots", "LoRALoads"]


class LoRALoads:
    def __init__(self) -> None:
        self.ready: set[int] = set()  # adapter ids the workers hold in host memory
        self.loading: set[int] = set()  # asked for, not reported read yet
        self._pending: list[LoRARequest] = []  # to ask for in the next plan sent
        self.poll: int | None = None  # the step id of a plan out that only waits for reads

    def request(self, lora: LoRARequest) -> None:
        """Asks for an adapter's files, unless the workers have them or are reading them."""
        if lora.lora_int_id not in self.ready and lora.lora_int_id not in self.loading:
            self.loading.add(lora.lora_int_id)
            self._pending.append(lora)

    def take_pending(self) -> tuple[LoRARequest, ...]:
        """The adapters to ask for in the plan about to be sent."""
        pending, self._pending = tuple(self._pending), []
        return pending

    def apply(self, result: StepResult) -> dict[int, str]:
        """Takes a result's news; returns the adapters the workers could not read, with why."""
        self.ready.update(result.loaded_loras)
        self.loading.difference_update(result.loaded_loras)
        self.ready.difference_update(result.evicted_loras)
        failed = dict(result.failed_loras)
        self.loading.difference_update(failed)
        self.ready.difference_update(failed)
        if result.step_id == self.poll:
            self.poll = None
        return failed

    def reset(self) -> None:
        """New workers hold no adapter: each is asked for again before its sequences run."""
        self.ready.clear()
        self.loading.clear()
        self._pending = []
        self.poll = None


class AdapterSlots:
    """One admission pass over the waiting sequences, as far as their adapters go: the workers
    hold at most ``max_loras`` adapters at once (``None``: no LoRA). A sequence of an adapter
    not read yet is passed by the others (and its adapter asked for again, in case the workers
    dropped it); once one waits for a free slot, no adapter's sequence passes it, so the running
    adapters' sequences end and free one."""

    def __init__(self, loads: LoRALoads, max_loras: int | None, running: Iterable[LoRARequest | None]) -> None:
        self._loads = loads
        self._max_loras = max_loras or 0
        self._in_use = {lora.lora_int_id for lora in running if lora is not None} if max_loras else set()
        self._slot_wanted = False

    def admits(self, lora: LoRARequest) -> bool:
        """Whether a sequence of ``lora`` may be admitted now; if so, its adapter takes a slot."""
        if lora.lora_int_id not in self._loads.ready:
            self._loads.request(lora)
            return False
        if self._slot_wanted:
            return False
        if lora.lora_int_id not in self._in_use and len(self._in_use) >= self._max_loras:
            self._slot_wanted = True
            return False
        return True

    def admitted(self, lora: LoRARequest) -> None:
        self._in_use.add(lora.lora_int_id)
