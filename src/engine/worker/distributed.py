"""Tensor parallelism: how a Llama-family model is split over ranks, and the process group the
ranks form over ``torch.distributed`` (gloo on CPU, NCCL on CUDA) once they have met
(:mod:`triode.engine.worker.rendezvous`).

Partitioning rule (Megatron style, by whole GQA groups):

- attention: each rank owns a contiguous range of KV heads and the query heads that read
  them (query head ``h`` reads KV head ``h // (heads / kv_heads)``), so attention never
  crosses ranks. With ``size <= kv_heads`` every rank gets ``kv_heads // size`` or one more
  whole KV head (an uneven split when ``size`` does not divide ``kv_heads``, e.g. SmolLM2's
  3 KV heads at size 2: 1 + 2). With ``size > kv_heads`` each KV head is replicated on
  ``size // kv_heads`` ranks that split its query heads; that needs ``size`` to be a
  multiple of ``kv_heads`` and to divide ``heads``.
- MLP: gate/up rows and down columns split into contiguous, balanced ranges of the
  intermediate size; o_proj and down_proj are row-parallel (partial sums + all-reduce).
- vocabulary: embedding rows (and LM head rows) split into balanced contiguous ranges; the
  embedding masks ids outside its range and all-reduces, the LM head's partial logits are
  gathered on rank 0, which alone samples (the other ranks need no token: the next plan
  carries it).

The sizes a model supports are listed by :func:`triode.engine.tensor_parallel.supported_sizes`;
:func:`triode.engine.tensor_parallel.check_tensor_parallel` raises naming them (the engine process
calls it before it spawns any rank, ``Partition.of`` again in each rank). No trio here: this
runs inside worker processes.
"""

from __future__ import annotations

import contextlib
import datetime
import time
from typing import TYPE_CHECKING

import attrs
import torch

from triode import kernels
from triode.engine.tensor_parallel import (
    Rendezvous,
    RendezvousError,
    balanced_share,
    check_tensor_parallel,
)

if TYPE_CHECKING:
    from triode.engine.model.config import ModelConfig


@attrs.frozen(kw_only=True)
class Partition:
    """What one rank owns: [start, stop) ranges of query heads, KV heads, intermediate
    features and vocabulary rows."""

    rank: int
    size: int
    q_heads: tuple[int, int]
    kv_heads: tuple[int, int]
    intermediate: tuple[int, int]
    vocab: tuple[int, int]
    max_kv_heads: int  # the most KV heads any rank holds: sizes every rank's KV cache alike
    vocab_width: int  # the widest vocabulary shard: partial logits are padded to it
    vocab_total: int
    moe_intermediate: tuple[int, int] = (0, 0)  # of every expert's features

    @classmethod
    def of(cls, config: ModelConfig, rank: int, size: int) -> Partition:
        check_tensor_parallel(config, size)
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} is outside a group of {size}")
        heads, kv_heads = config.num_heads, config.num_kv_heads
        group = heads // kv_heads
        if size <= kv_heads:
            kv = balanced_share(kv_heads, rank, size)
            q = (kv[0] * group, kv[1] * group)
            max_kv = -(-kv_heads // size)
        else:
            replicas = size // kv_heads
            head = rank // replicas
            kv = (head, head + 1)
            per_rank = heads // size
            first = head * group + (rank % replicas) * per_rank
            q = (first, first + per_rank)
            max_kv = 1
        return cls(
            rank=rank, size=size, q_heads=q, kv_heads=kv,
            intermediate=balanced_share(config.intermediate_size, rank, size),
            vocab=balanced_share(config.vocab_size, rank, size),
            max_kv_heads=max_kv, vocab_width=-(-config.vocab_size // size),
            vocab_total=config.vocab_size,
            moe_intermediate=balanced_share(config.moe_intermediate_size, rank, size),
        )

    def vocab_shards(self) -> list[tuple[int, int]]:
        """Every rank's vocabulary range, in rank order."""
        return [balanced_share(self.vocab_total, rank, self.size) for rank in range(self.size)]

    @property
    def num_q_heads(self) -> int:
        return self.q_heads[1] - self.q_heads[0]

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]

    @property
    def intermediate_size(self) -> int:
        return self.intermediate[1] - self.intermediate[0]

    @property
    def moe_intermediate_size(self) -> int:
        return self.moe_intermediate[1] - self.moe_intermediate[0]

    @property
    def vocab_size(self) -> int:
        return self.vocab[1] - self.vocab[0]


# --- the process group ---------------------------------------------------------------------


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


class TensorParallelGroup:
    """One rank's membership of the (default) process group, and the collectives the model
    uses. Every collective's wall time accumulates in ``collective_seconds`` (the runner resets
    it per step). On CPU that is the whole collective, waiting for the slowest rank included;
    on CUDA, where NCCL calls are asynchronous, it is the host-side time only."""

    def __init__(self, partition: Partition, device: torch.device | None = None) -> None:
        self.partition = partition
        self.device = device or torch.device("cpu")  # where collectives' tensors live (NCCL: the GPU)
        self.rank = partition.rank
        self.size = partition.size
        self.collective_seconds = 0.0

    @classmethod
    def join(
        cls,
        partition: Partition,
        rendezvous: Rendezvous,
        device: torch.device,
        store: torch.distributed.Store | None = None,
    ) -> TensorParallelGroup:
        """Joins the default process group as ``partition.rank`` (rank 0 passes the store it
        serves; the others connect to ``rendezvous``)."""
        import torch.distributed as dist

        rank = partition.rank
        timeout = datetime.timedelta(seconds=rendezvous.timeout_s)
        if dist.is_initialized():
            dist.destroy_process_group()
        try:
            if store is None:
                store = dist.TCPStore(rendezvous.host, rendezvous.port, is_master=False, timeout=timeout)
            dist.init_process_group(
                backend_for(device), store=store, rank=rank, world_size=rendezvous.world_size,
                timeout=timeout, device_id=device if device.type == "cuda" else None,
            )
        except RuntimeError as e:
            raise RendezvousError(
                f"rank {rank} could not join the tensor-parallel group at "
                f"{rendezvous.host}:{rendezvous.port}: {e}"
            ) from None
        return cls(partition, device)

    def leave(self) -> None:
        import torch.distributed as dist

        with contextlib.suppress(Exception):
            if dist.is_initialized():
                dist.destroy_process_group()

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sums ``x`` over the ranks, in place. Under ``--batch-invariant`` with more than two
        ranks, in rank order: a ring or tree all-reduce chunks the message by its size, so the
        order of each element's sum would follow the batch (two ranks' one addition has none)."""
        started = time.perf_counter()
        if self.size > 2 and kernels.batch_invariant():
            pieces = [torch.empty_like(x) for _ in range(self.size)]
            torch.distributed.all_gather(pieces, x.contiguous())
            total = pieces[0]
            for piece in pieces[1:]:
                total = total + piece
            x.copy_(total)
        else:
            torch.distributed.all_reduce(x)
        self.collective_seconds += time.perf_counter() - started
        return x

    def agree_on_minimum(self, value: int) -> int:
        """The smallest of the ranks' ``value``s, on every rank (at start-up)."""
        agreed = torch.tensor([value], dtype=torch.int64, device=self.device)
        torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MIN)
        return int(agreed.item())

    def broadcast_tokens(self, tokens: list[int] | None, count: int) -> list[int]:
        """Rank 0's ``count`` sampled token ids on every rank (rank 0 passes them, the others
        None)."""
        values = (torch.tensor(tokens, dtype=torch.int64, device=self.device) if tokens is not None
                  else torch.empty(count, dtype=torch.int64, device=self.device))
        started = time.perf_counter()
        torch.distributed.broadcast(values, src=0)
        self.collective_seconds += time.perf_counter() - started
        return values.tolist()

    def gather_vocab(self, partial: torch.Tensor) -> torch.Tensor | None:
        """Rank 0 gets the full [rows, vocab] logits from every rank's [rows, shard] part; the
        other ranks get None."""
        partition = self.partition
        width = partition.vocab_width
        if partial.shape[-1] != width:  # uneven shards: equal-size pieces for the gather
            partial = torch.nn.functional.pad(partial, (0, width - partial.shape[-1]))
        partial = partial.contiguous()
        started = time.perf_counter()
        pieces = [torch.empty_like(partial) for _ in range(self.size)] if self.rank == 0 else None
        torch.distributed.gather(partial, pieces, dst=0)
        self.collective_seconds += time.perf_counter() - started
        if pieces is None:
            return None
        if partition.vocab_width * self.size != partition.vocab_total:
            pieces = [
                piece[:, : stop - start]
                for piece, (start, stop) in zip(pieces, partition.vocab_shards(), strict=True)
            ]
        return torch.cat(pieces, dim=-1)


def peak_resident_bytes() -> int | None:
    """This process's peak resident set (VmHWM), or None where /proc is not available."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
