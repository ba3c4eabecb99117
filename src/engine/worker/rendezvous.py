"""The rendezvous store, inside the ranks: rank 0 serves a ``torch.distributed`` TCPStore
where the ranks meet (the address is chosen and checked by :mod:`triode.engine.tensor_parallel`)
and form their process group (:class:`triode.engine.worker.distributed.TensorParallelGroup`).
Followers (ranks on other nodes, :mod:`triode.engine.worker.follower`) read the engine arguments
rank 0 announced in the store, and each step's plan from a :class:`PlanFeed` on it.

No trio here: this runs inside worker processes.
"""

from __future__ import annotations

import datetime

import torch

from triode.engine.tensor_parallel import Rendezvous, RendezvousError

_GENERATION_KEY = "triode/generation"
_ARGS_KEY = "triode/args"


def serve_store(host: str, port: int | None, timeout_s: float) -> torch.distributed.TCPStore:
    """Rank 0's store (the rendezvous server) on ``port``, or on a free port when None."""
    import torch.distributed as dist

    try:
        return dist.TCPStore(
            host, port or 0, is_master=True, wait_for_workers=False,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    except RuntimeError as e:
        raise RendezvousError(
            f"cannot serve the tensor-parallel rendezvous on {host}:{port or 0}: {e}"
        ) from None


def announce(store, args, rendezvous: Rendezvous) -> str:
    """Rank 0, before joining: publishes the engine arguments and a new group generation for
    followers; returns the generation (it names the plan keys of this group)."""
    import pickle
    import uuid

    generation = uuid.uuid4().hex
    store.set(_ARGS_KEY, pickle.dumps((args, rendezvous.world_size)))
    store.set(_GENERATION_KEY, generation)
    return generation


def wait_for_announcement(store, poll_s: float = 5.0) -> tuple[str, object, int]:
    """A follower: (generation, EngineArgs, world size) of the group rank 0 announced."""
    import pickle

    _wait(store, _GENERATION_KEY, poll_s)
    generation = store.get(_GENERATION_KEY).decode()
    args, world_size = pickle.loads(store.get(_ARGS_KEY))
    return generation, args, world_size


def _wait(store, key: str, poll_s: float) -> None:
    import torch.distributed as dist

    while True:
        try:
            store.wait([key], datetime.timedelta(seconds=poll_s))
            return
        except dist.DistStoreError:  # a timeout: still idle; a lost connection raises on
            continue


class PlanFeed:
    """Each step's plan from rank 0 to the followers, through the rendezvous store (the
    engine hands plans only to the ranks it runs). Keys are numbered per group generation;
    a step that ran collectives proves every follower has read its plans, so rank 0 then
    deletes them."""

    def __init__(self, store, generation: str) -> None:
        self._store = store
        self._prefix = f"triode/{generation}/plan/"
        self._next = 0
        self._unsettled: list[str] = []

    def publish(self, plan) -> None:
        import pickle

        key = f"{self._prefix}{self._next}"
        self._next += 1
        self._store.set(key, pickle.dumps(plan))
        self._unsettled.append(key)

    def settle(self) -> None:
        for key in self._unsettled:
            self._store.delete_key(key)
        self._unsettled.clear()

    def receive(self, poll_s: float = 5.0):
        import pickle

        key = f"{self._prefix}{self._next}"
        _wait(self._store, key, poll_s)
        self._next += 1
        return pickle.loads(self._store.get(key))
