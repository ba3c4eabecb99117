"""Where the tensor-parallel ranks meet, and how followers get the engine's plans.

Rank 0 serves a ``torch.distributed`` TCPStore (at ``MASTER_ADDR:MASTER_PORT``, or on a free
loopback port); the other ranks connect to it to form their process group
(:class:`engine.worker.distributed.TensorParallelGroup`). Ranks the engine does not run itself
(``TRIODE_TP_LOCAL_RANKS`` below the world size: multi-node) are followers
(:mod:`engine.worker.follower`): they read the engine arguments rank 0 announced in the store,
and each step's plan from a :class:`PlanFeed` on it. This module imports no trio: it runs
inside worker processes, and the engine side only calls the checks before it spawns any rank.
"""

from __future__ import annotations

import datetime
import os
import socket

import attrs
import torch

from engine.errors import TriodeError

MASTER_ADDR_ENV = "MASTER_ADDR"
MASTER_PORT_ENV = "MASTER_PORT"
LOCAL_RANKS_ENV = "TRIODE_TP_LOCAL_RANKS"  # ranks the engine runs; the rest are followers
_LOOPBACK = "127.0.0.1"
_GENERATION_KEY = "triode/generation"
_ARGS_KEY = "triode/args"


class RendezvousError(TriodeError):
    """The ranks could not form their process group (e.g. ``MASTER_PORT`` is taken)."""


@attrs.frozen(kw_only=True)
class Rendezvous:
    """Where the ranks meet: rank 0 serves a TCPStore at ``host:port``; the others connect.
    Ranks ``local_ranks ..`` run elsewhere (followers, see ``engine.worker.follower``)."""

    host: str
    port: int
    world_size: int
    timeout_s: float = 300.0
    local_ranks: int | None = None  # None: all of them run in this engine

    @property
    def has_followers(self) -> bool:
        return self.local_ranks is not None and self.local_ranks < self.world_size


def local_rank_count(world_size: int) -> int:
    """How many of the ``world_size`` ranks this engine runs (``TRIODE_TP_LOCAL_RANKS``; all
    by default). Fewer means multi-node: the others join as followers, which needs a fixed
    ``MASTER_PORT`` to find rank 0."""
    raw = os.environ.get(LOCAL_RANKS_ENV)
    if not raw:
        return world_size
    try:
        count = int(raw)
    except ValueError:
        count = 0
    if not 1 <= count <= world_size:
        raise RendezvousError(
            f"{LOCAL_RANKS_ENV}={raw!r} must be a number of ranks from 1 to "
            f"tensor_parallel_size={world_size}"
        )
    if count < world_size and not os.environ.get(MASTER_PORT_ENV):
        raise RendezvousError(
            f"{LOCAL_RANKS_ENV}={count} leaves ranks {count}..{world_size - 1} to follower "
            f"processes, which find rank 0 at {MASTER_ADDR_ENV}:{MASTER_PORT_ENV}: set both"
        )
    return count


def rendezvous_address() -> tuple[str, int | None]:
    """``(MASTER_ADDR, MASTER_PORT)`` from the environment; without MASTER_PORT the port is
    None (rank 0 binds a free one). Without MASTER_ADDR the ranks meet on loopback."""
    host = os.environ.get(MASTER_ADDR_ENV) or _LOOPBACK
    raw = os.environ.get(MASTER_PORT_ENV)
    if not raw:
        return host, None
    try:
        port = int(raw)
    except ValueError:
        port = -1
    if not 0 < port < 65536:
        raise RendezvousError(f"{MASTER_PORT_ENV}={raw!r} is not a TCP port (1-65535)")
    return host, port


def check_port_free(port: int) -> None:
    """Raises ``RendezvousError`` when ``port`` cannot be listened on here (bound the way the
    TCPStore binds it), so a taken port fails before any rank is spawned."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("", port))
        except OSError as e:
            raise RendezvousError(
                f"{MASTER_PORT_ENV}={port} is not free for the tensor-parallel rendezvous "
                f"({e.strerror}); choose another port or unset {MASTER_PORT_ENV} to use a free one"
            ) from None


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
