"""Tensor-parallel ranks without the engine: ``run_sharded`` spawns ``world_size`` processes
that form a gloo group and drive their ModelRunners in lockstep with tests.driver's Driver,
so the sharded model math is tested without the supervisor. One spawn serves many models
(each job joins a fresh process group), because starting processes is the slow part.

Only rank 0 samples; the driver on the other ranks gets rank 0's tokens by a broadcast,
which stands in for the engine's next plan."""

from __future__ import annotations

import multiprocessing
import traceback
from collections.abc import Sequence
from pathlib import Path

import attrs
import torch

from triode.engine.config import EngineArgs
from triode.engine.sampling_params import SamplingParams


@attrs.frozen(kw_only=True)
class Job:
    path: Path
    prompts: tuple[tuple[int, ...], ...]
    params: SamplingParams
    args: EngineArgs


def _run_job(rank: int, world_size: int, port: int, job: Job):
    import torch.distributed as dist

    from tests.driver import Driver
    from triode.engine.tensor_parallel import Rendezvous
    from triode.engine.worker.runner import ModelRunner

    rendezvous = Rendezvous(host="127.0.0.1", port=port, world_size=world_size, timeout_s=60)
    runner = ModelRunner(job.args, job.path, rank=rank, rendezvous=rendezvous)
    try:
        driver = Driver(runner)
        plain_run = driver.run

        def run(chunks, new_sequences=()):
            sampled = [plain_run(chunks, new_sequences)]
            dist.broadcast_object_list(sampled, src=0)
            return sampled[0]

        driver.run = run
        return driver.generate([list(p) for p in job.prompts], job.params)
    finally:
        runner.close()


def _rank_main(rank: int, world_size: int, ports: Sequence[int], jobs: Sequence[Job], results) -> None:
    torch.set_num_threads(1)
    try:
        outputs = [_run_job(rank, world_size, port, job) for port, job in zip(ports, jobs, strict=True)]
        results.put((rank, outputs if rank == 0 else None, None))
    except BaseException:
        results.put((rank, None, traceback.format_exc()))


def run_sharded(world_size: int, jobs: Sequence[Job], *, timeout: float = 300.0) -> list:
    """Rank 0's ``Driver.generate`` output for each job, computed by ``world_size`` ranks."""
    import torch.distributed as dist

    # The stores live here, one per job (a process group is formed once per store).
    stores = [dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False) for _ in jobs]
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    processes = [
        context.Process(
            target=_rank_main, args=(rank, world_size, [s.port for s in stores], list(jobs), results),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    failed = False
    try:
        outputs = None
        for _ in processes:
            rank, rank_outputs, error = results.get(timeout=timeout)
            if error:  # its peers may now wait in a collective: no point reading on
                failed = True
                raise RuntimeError(f"rank {rank} failed:\n{error}")
            if rank == 0:
                outputs = rank_outputs
        return outputs
    finally:
        for process in processes:
            process.join(timeout=1 if failed else 30)
            if process.is_alive():
                process.kill()
                process.join()
