"""How many bytes of KV cache a rank allocates when ``kv_cache_memory`` is not given.

vLLM's idea (``gpu_memory_utilization``): the engine may fill a fraction of the memory it
runs in, and what the weights and a step's activations leave of that fraction is KV cache.

- On a GPU the fraction is of the device's total memory (vLLM's meaning, default 0.9):
  ``fraction x total - in use after the weights - activations``.
- On a CPU it is of the memory the machine has available once the weights are in (default
  0.5: the host also runs the server, the tokenizer and the page cache the checkpoint is read
  through), shared equally by the ranks of one host and bounded by the cgroup's limit:
  ``fraction x available / ranks - activations``.

Either way no rank takes more than ``max_num_seqs`` sequences of ``max_model_len`` can fill:
more would never be used. The reading is logged at start-up; an explicit
``kv_cache_memory`` is taken as it is, unless the machine (or the device) does not have that
much memory at all (:func:`check_given_budget`). The rule (:func:`automatic_kv_cache_bytes`) is
sans-IO; :func:`read_memory` is the measurement; :func:`size_kv_cache` puts them together for
a worker. :func:`blocks_for_budget` turns a budget, given or sized, into the rank's blocks.
"""

from __future__ import annotations

from pathlib import Path

import attrs
import torch

from triode.engine.config import EngineArgs
from triode.engine.core.kv_blocks import blocks_in_use_at_most
from triode.engine.errors import KVCacheTooLargeError, KVCacheTooSmallError
from triode.engine.model.config import ModelConfig
from triode.engine.worker.distributed import TensorParallelGroup
from triode.engine.worker.draft_model import draft_kv_share, kv_bytes_per_token

CPU_MEMORY_UTILIZATION = 0.5
GPU_MEMORY_UTILIZATION = 0.9


@attrs.frozen(kw_only=True)
class MemoryReading:
    """The memory a rank runs in: ``total`` bytes, of which ``available`` are free to take."""

    total: int
    available: int
    on_gpu: bool


def default_memory_utilization(on_gpu: bool) -> float:
    return GPU_MEMORY_UTILIZATION if on_gpu else CPU_MEMORY_UTILIZATION


def automatic_kv_cache_bytes(reading: MemoryReading, *, utilization: float, ranks_sharing: int,
                             activation_bytes: int, most_useful_bytes: int) -> int:
    """The rank's KV budget in bytes (0 where nothing is left; the caller reports that as a
    budget too small for one sequence)."""
    if reading.on_gpu:
        in_use = reading.total - reading.available
        budget = utilization * reading.total - in_use - activation_bytes
    else:
        budget = utilization * reading.available / ranks_sharing - activation_bytes
    return max(0, min(int(budget), most_useful_bytes))


def check_given_budget(budget: int, reading: MemoryReading, *, ranks_sharing: int) -> str | None:
    """An explicit budget of every rank that shares the memory of ``reading``: more than that
    memory's total raises ``KVCacheTooLargeError`` (no step could ever fill it, and its first
    allocation failed with a bare ENOMEM, or with an overflow, naming the model); more than is
    available now returns a warning, since the cache's pages are committed only as sequences
    fill them (it may still fit, and an explicit setting wins)."""
    wanted = budget * ranks_sharing
    ranks = f" x {ranks_sharing} ranks" if ranks_sharing > 1 else ""
    where = "the device" if reading.on_gpu else "this machine"
    given = f"kv_cache_memory={budget / 2**30:.2f} GiB{ranks}"
    if wanted > reading.total:
        raise KVCacheTooLargeError(f"{given} is more than the {reading.total / 2**30:.2f} GiB of memory {where} has "
                                   f"(lower it, or leave it unset to size the cache from memory)")
    if wanted > reading.available:
        return (f"{given} is more than the {reading.available / 2**30:.2f} GiB of memory available once the weights "
                f"were in: a full cache may run {where} out of memory")
    return None


def activation_bytes(*, max_num_batched_tokens: int, hidden_size: int, intermediate_size: int,
                     vocab_size: int, element_size: int) -> int:
    """What the largest step's activations hold at once, about: a chunk of
    ``max_num_batched_tokens`` rows through the widest layer, and its last rows' logits in
    float32 (a step samples at most one row per sequence, but a prefill may run them all)."""
    widest = max(3 * hidden_size, 2 * intermediate_size)
    return max_num_batched_tokens * (widest * element_size + vocab_size * 4)


def size_kv_cache(args: EngineArgs, *, device: torch.device, config: ModelConfig, dtype: torch.dtype,
                  kv_heads: int, max_model_len: int, reserved_blocks: int,
                  parallel: TensorParallelGroup | None) -> tuple[int, str, MemoryReading]:
    """A worker's automatic budget (the same on every rank), how it was chosen (for the
    start-up log), and the reading it started from. ``kv_heads``: the most any rank holds."""
    on_gpu = device.type == "cuda"
    reading = read_memory(device.type, device.index)
    utilization = args.gpu_memory_utilization or default_memory_utilization(on_gpu)
    per_token = kv_bytes_per_token(config, dtype, kv_heads)
    most_useful_blocks = args.max_num_seqs * -(-max_model_len // args.block_size) + reserved_blocks
    # a draft model's cache comes out of the same budget, in proportion
    most_useful = int(most_useful_blocks * args.block_size * per_token / (1 - draft_kv_share(args, per_token, dtype)))
    activations = activation_bytes(max_num_batched_tokens=args.max_num_batched_tokens, hidden_size=config.hidden_size,
                                   intermediate_size=config.intermediate_size, vocab_size=config.vocab_size,
                                   element_size=torch.empty((), dtype=dtype).element_size())
    size = parallel.size if parallel is not None else 1
    budget = automatic_kv_cache_bytes(reading, utilization=utilization, ranks_sharing=1 if on_gpu else size,
                                      activation_bytes=activations, most_useful_bytes=most_useful)
    if parallel is not None:
        # each rank read the memory at its own moment: every rank takes the smallest
        budget = parallel.agree_on_minimum(budget)
    basis = f"the device's {reading.total / 2**30:.2f} GiB" if on_gpu else \
        f"the {reading.available / 2**30:.2f} GiB available once the weights were in"
    sizing = f"sized as {utilization:g} of {basis}" + (
        ", capped at what max_num_seqs sequences of max_model_len fill" if budget == most_useful else "")
    return budget, sizing, reading


def blocks_for_budget(budget: int, args: EngineArgs, *, config: ModelConfig, dtype: torch.dtype, kv_heads: int,
                      max_model_len: int, reserved_blocks: int, reading: MemoryReading | None = None,
                      ) -> tuple[int, int]:
    """The blocks a rank's ``budget`` bytes hold (``kv_heads``: the most any rank holds, so that
    every rank has as many), less ``reserved_blocks``, and the bytes a draft model's cache takes
    of it first (the same share on every rank; only rank 0 allocates it). One sequence of
    ``max_model_len`` must fit, or ``KVCacheTooSmallError`` says so, naming ``reading`` where
    the budget was sized from one."""
    per_token = kv_bytes_per_token(config, dtype, kv_heads)
    per_block = args.block_size * per_token
    draft_bytes = int(budget * draft_kv_share(args, per_token, dtype))
    budget_bytes = budget - draft_bytes
    num_blocks = budget_bytes // per_block - reserved_blocks
    # With a window on every layer, only the part of a sequence the scheduler keeps at once
    # must fit (its blocks behind the window are freed).
    needed = blocks_in_use_at_most(max_model_len, args.block_size, sliding_window=config.kv_window,
                                   max_chunk=args.max_num_batched_tokens)
    if num_blocks < needed:
        note = "" if reading is None else (
            f"; the budget was sized from the {reading.available / 2**30:.2f} GiB of memory available "
            f"once the weights were in (of {reading.total / 2**30:.2f} GiB)")
        raise KVCacheTooSmallError(
            f"a KV-cache budget of {budget_bytes} bytes holds {num_blocks * args.block_size} tokens, "
            f"fewer than the {needed * args.block_size} one sequence of max_model_len={max_model_len} "
            f"may hold at once (raise kv_cache_memory or lower max_model_len){note}"
        )
    return num_blocks, draft_bytes


def read_memory(device_type: str, device_index: int | None = None) -> MemoryReading:
    if device_type == "cuda":
        free, total = torch.cuda.mem_get_info(device_index)
        return MemoryReading(total=total, available=free, on_gpu=True)
    meminfo = _meminfo()
    total, available = meminfo["MemTotal"], meminfo["MemAvailable"]
    limit = _cgroup_room()
    if limit is not None:
        total, available = min(total, limit[0]), min(available, limit[1])
    return MemoryReading(total=total, available=available, on_gpu=False)


def _meminfo(path: Path = Path("/proc/meminfo")) -> dict[str, int]:
    values = {}
    for line in path.read_text().splitlines():
        name, _, rest = line.partition(":")
        values[name] = int(rest.split()[0]) * 1024  # kB
    return values


def _cgroup_room(root: Path = Path("/sys/fs/cgroup")) -> tuple[int, int] | None:
    """(limit, limit - usage) of this process's memory cgroup, or None where it has no limit:
    a container's limit, not the host's free memory, is what the kernel enforces."""
    for limit_file, usage_file in (("memory.max", "memory.current"),  # cgroup v2
                                   ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")):
        try:
            raw_limit = (root / limit_file).read_text().strip()
            usage = int((root / usage_file).read_text())
        except (OSError, ValueError):
            continue
        if not raw_limit.isdigit() or int(raw_limit) >= 1 << 60:  # "max", or v1's "unlimited"
            return None
        return int(raw_limit), max(0, int(raw_limit) - usage)
    return None
