"""A tensor-parallel rank on another node: ``python -m triode.engine.worker.follower --rank R``.

The engine runs ranks ``0 .. TRIODE_TP_LOCAL_RANKS-1`` itself; every other rank is a
follower started by hand (or by a service manager) on its own node, with the same
``MASTER_ADDR`` / ``MASTER_PORT`` as the engine::

    # node A (rank 0 and the engine):
    MASTER_ADDR=10.0.0.1 MASTER_PORT=29500 TRIODE_TP_LOCAL_RANKS=1 \\
        triode serve --tensor-parallel-size 2
    # node B:
    MASTER_ADDR=10.0.0.1 MASTER_PORT=29500 python -m triode.engine.worker.follower --rank 1

A follower waits for rank 0's announcement (the engine arguments and a group generation),
loads its shard, joins the process group and then runs every plan rank 0 forwards through
the rendezvous store, in lockstep with the engine's ranks. When the group ends (the engine
restarts its ranks after a failure, or shuts down), the follower drops its model and waits
for the next announcement, so a restart of the engine's group takes it along. It never
samples: only rank 0 does. No trio here; this is worker-side code.
"""

from __future__ import annotations

import os

# Before torch loads: idle waits on the store end in timeouts that torch's C++ layer would
# log as warnings, one per poll.
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

import argparse
import datetime
import sys
import time
from pathlib import Path

import torch

from triode.engine.cpus import usable_cpus
from triode.engine.tensor_parallel import (
    MASTER_PORT_ENV,
    Rendezvous,
    RendezvousError,
    rendezvous_address,
)
from triode.engine.worker.rendezvous import PlanFeed, wait_for_announcement


def _say(message: str) -> None:
    print(f"triode follower: {message}", file=sys.stderr, flush=True)


def serve(
    rank: int,
    *,
    host: str,
    port: int,
    model: str | None = None,
    local_rank: int | None = None,
    num_threads: int | None = None,
    groups: int | None = None,
    retry_s: float = 1.0,
) -> None:
    """Joins group after group as ``rank``; returns after ``groups`` groups (None: never)."""
    import torch.distributed as dist

    from triode.engine.model_files.resolve import resolve_model
    from triode.engine.worker.host_memory import keep_freed_memory
    from triode.engine.worker.runner import ModelRunner

    torch.set_num_threads(num_threads or usable_cpus())
    keep_freed_memory()
    joined: str | None = None
    served = 0
    while groups is None or served < groups:
        runner = None
        try:
            store = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=60))
            generation, args, world_size = wait_for_announcement(store)
            if generation == joined:  # the ended group's store is still up: wait for the next
                time.sleep(retry_s)
                continue
            if not 0 < rank < world_size:
                raise RendezvousError(f"rank {rank} is not a follower rank of a group of {world_size}")
            path = resolve_model(model or args.model, cache_dir=args.resolved_cache_dir(),
                                 quantization=args.quantization).path
            _say(f"rank {rank} of {world_size}: loading {path} and joining {host}:{port}")
            rendezvous = Rendezvous(host=host, port=port, world_size=world_size,
                                    timeout_s=max(120.0, 2 * args.step_timeout))
            runner = ModelRunner(args, Path(path), rank=rank, rendezvous=rendezvous, store=store,
                                 local_rank=local_rank)
            joined = generation
            served += 1
            _say(f"rank {rank} joined group {generation[:8]}")
            feed = PlanFeed(store, generation)
            while True:
                runner.execute(feed.receive())
        except RendezvousError:
            raise
        except RuntimeError as e:  # the group or its store went away (torch's DistError too)
            if joined is not None:
                _say(f"rank {rank}: group {joined[:8]} ended ({str(e).splitlines()[0][:200]})")
            time.sleep(retry_s)
        finally:
            if runner is not None:
                runner.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m triode.engine.worker.follower", description=__doc__.split("\n")[0])
    parser.add_argument("--rank", type=int, required=True, help="this process's tensor-parallel rank (>= 1)")
    parser.add_argument("--model", default=None,
                        help="the model here, if its path differs from the engine's --model")
    parser.add_argument("--local-rank", type=int, default=None, help="CUDA device index on this node")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: all cores)")
    parser.add_argument("--groups", type=int, default=None,
                        help="exit after serving this many groups (default: run until killed)")
    options = parser.parse_args(argv)
    try:
        host, port = rendezvous_address()
        if port is None:
            raise RendezvousError(f"set {MASTER_PORT_ENV} (and MASTER_ADDR) to the engine's rendezvous")
        serve(options.rank, host=host, port=port, model=options.model, local_rank=options.local_rank,
              num_threads=options.threads, groups=options.groups)
    except RendezvousError as e:
        _say(str(e))
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
