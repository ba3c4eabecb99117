"""Tensor parallelism as the engine process sees it, before any rank is spawned: which sizes
can shard a model, and where the ranks meet.

Partitioning rule (Megatron style, by whole GQA groups): attention splits by whole KV heads
(and the query heads that read them), or, with more ranks than KV heads, replicates each KV
head on ``size // kv_heads`` ranks that split its query heads; the MLP and the vocabulary
split into balanced contiguous ranges (``triode.engine.worker.distributed.Partition`` holds a
rank's share). The ranks meet at a ``torch.distributed`` TCPStore that rank 0 serves, at
``MASTER_ADDR:MASTER_PORT`` or on a free loopback port; ranks past ``TRIODE_TP_LOCAL_RANKS``
run on other nodes as followers (``triode.engine.worker.follower``).

The worker processes import this module too (their partition and their rendezvous); it
imports no torch at module level, so the engine process stays free of it.
"""

from __future__ import annotations

import os
import socket
from typing import TYPE_CHECKING

import attrs

from triode.engine.errors import InvalidRequestError, TriodeError
from triode.engine.model.config import ModelConfig
from triode.engine.model_files.layout import load_hf_config

if TYPE_CHECKING:
    from triode.engine.config import EngineArgs

MASTER_ADDR_ENV = "MASTER_ADDR"
MASTER_PORT_ENV = "MASTER_PORT"
LOCAL_RANKS_ENV = "TRIODE_TP_LOCAL_RANKS"  # ranks the engine runs; the rest are followers
_LOOPBACK = "127.0.0.1"


class RendezvousError(TriodeError):
    """The ranks could not form their process group (e.g. ``MASTER_PORT`` is taken)."""


@attrs.frozen(kw_only=True)
class Rendezvous:
    """Where the ranks meet: rank 0 serves a TCPStore at ``host:port``; the others connect.
    Ranks ``local_ranks ..`` run elsewhere (followers, see ``triode.engine.worker.follower``)."""

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


class TensorParallelSizeError(InvalidRequestError):
    """``tensor_parallel_size`` cannot shard this model (or exceeds the CUDA devices); the
    message names the constraint and the supported sizes."""

    def __init__(self, message: str) -> None:
        super().__init__(message, field="tensor_parallel_size")

    def __reduce__(self):  # crosses the worker-process boundary by pickle
        return (type(self), (str(self),))


def balanced_share(total: int, rank: int, size: int) -> tuple[int, int]:
    """Rank's contiguous share of ``total`` items: sizes differ by at most one."""
    return total * rank // size, total * (rank + 1) // size


def _attention_problem(num_heads: int, num_kv_heads: int, size: int) -> str | None:
    if size <= num_kv_heads:
        return None
    if size % num_kv_heads:
        return (f"with more ranks than KV heads ({num_kv_heads}), each KV head is replicated, "
                f"so tensor_parallel_size must be a multiple of {num_kv_heads}")
    if num_heads % size:
        return (f"with more ranks than KV heads ({num_kv_heads}), tensor_parallel_size must "
                f"divide the {num_heads} attention heads")
    return None


def supported_sizes(config: ModelConfig) -> list[int]:
    """Every tensor-parallel size that can shard the model (never more than its heads)."""
    limit = min(config.num_heads, config.intermediate_size, config.vocab_size)
    return [
        size for size in range(1, limit + 1)
        if _attention_problem(config.num_heads, config.num_kv_heads, size) is None
    ]


def check_tensor_parallel(
    config: ModelConfig,
    size: int,
    *,
    device: str | None = None,
    local_ranks: int | None = None,
) -> None:
    """Raises ``TensorParallelSizeError`` when ``size`` ranks cannot shard the model, or when
    the ranks run on CUDA (``device`` "cuda", or "auto" where CUDA is available) and this node
    has fewer devices than the ranks it runs (``local_ranks``, default all)."""
    problem = _attention_problem(config.num_heads, config.num_kv_heads, size)
    if problem is not None:
        sizes = ", ".join(map(str, supported_sizes(config)))
        raise TensorParallelSizeError(
            f"tensor_parallel_size={size} cannot shard {config.architecture} with "
            f"{config.num_heads} attention heads and {config.num_kv_heads} KV heads: {problem}; "
            f"supported sizes: {sizes}"
        )
    if device in ("cuda", "auto"):
        import torch  # only here: the engine process otherwise never needs it

        if device == "auto" and not torch.cuda.is_available():
            return
        available = torch.cuda.device_count()
        local = size if local_ranks is None else local_ranks
        if local > available:
            here = "" if local == size else f" ({local} of them on this node)"
            raise TensorParallelSizeError(
                f"tensor_parallel_size={size}{here} needs one CUDA device per rank, but only "
                f"{available} {'is' if available == 1 else 'are'} available"
            )


def check_before_spawn(args: EngineArgs, model_path: str) -> None:
    """The start-up checks of a tensor-parallel group that need no worker: the size against
    the model's heads (and the CUDA devices), and a MASTER_PORT that must be free."""
    if args.tensor_parallel_size == 1:
        return
    config = ModelConfig.from_hf(load_hf_config(model_path), source=f"{model_path}/config.json")
    check_tensor_parallel(
        config, args.tensor_parallel_size, device=args.device,
        local_ranks=local_rank_count(args.tensor_parallel_size),
    )
    _, port = rendezvous_address()
    if port is not None:
        check_port_free(port)
