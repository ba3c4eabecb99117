"""Which LoRA adapters the workers can run now: the scheduler's side of reading adapters in the
background (sans-IO).

An adapter's files are read by a thread of each worker while steps go on. The scheduler asks
for an adapter when a sequence of it arrives (``StepPlan.load_loras``), admits its sequences
once a step's result lists it read (``StepResult.loaded_loras``), and forgets it when the
workers drop it from host memory or restart. With nothing else to run and reads pending, a
chunkless plan that waits for a read (``StepPlan.wait_for_loads``) is the only way the engine
hears of one: one such plan is out at a time."""

from __future__ import annotations

from triode.engine.lora.request import LoRARequest
from triode.engine.worker_messages import StepResult

__all__ = ["LoRALoads"]


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
