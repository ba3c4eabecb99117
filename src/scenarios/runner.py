"""Plays scenarios: an undisturbed reference run, then the run with faults, then the verdict.

Servers are the expensive part (each start loads the model), so the runner keeps one
undisturbed server per set of reference arguments for its whole life. It serves the reference
runs, and also plays the scenarios whose faults only come from clients (disconnects, slow
readers, malformed input): those leave the server as they found it or fail. A scenario that
kills workers, stops the server or sets a fault plan gets a fresh server of its own."""

from __future__ import annotations

import math
import random
import signal

import attrs
import trio

from triode.scenarios.client import (
    Progress,
    RequestResult,
    RequestSpec,
    build_requests,
    play,
)
from triode.scenarios.faults import alive, malformed_burst, sigkill_worker
from triode.scenarios.judge import (
    Verdict,
    check_server_after,
    judge_requests,
    service_recovery,
)
from triode.scenarios.lora_files import LoRAAdapterFiles
from triode.scenarios.server import ServerProcess
from triode.scenarios.spec import Scenario, Workload

# Fields of a workload that decide the greedy outputs; how the requests arrive does not.
_OUTPUT_FIELDS = ("api", "requests", "prompt_tokens", "prompts", "max_tokens", "temperature", "seed",
                  "lora_adapters", "lora_rank")


def reference_key(scenario: Scenario, args: list[str]) -> tuple:
    """Scenarios that only compare outputs share a reference run whenever the outputs must be
    the same; one with a latency bound needs a reference with its own arrival pattern."""
    workload = scenario.workload
    if scenario.expect.max_p99_ratio is None:
        return (tuple(args), tuple(getattr(workload, name) for name in _OUTPUT_FIELDS))
    return (tuple(args), workload)


def _client_specs(scenario: Scenario) -> list[RequestSpec]:
    """The requests, with the disconnecting and slow-reading clients marked."""
    specs = build_requests(scenario.workload)
    rng = random.Random(scenario.workload.seed)
    for fault in scenario.faults_of("disconnect"):
        specs[: fault.clients] = [
            attrs.evolve(s, disconnect_after=rng.randint(1, fault.after_chunks)) for s in specs[: fault.clients]
        ]
    for fault in scenario.faults_of("slow_reader"):
        tail = len(specs) - fault.clients
        specs[tail:] = [attrs.evolve(s, read_interval=fault.chunk_interval) for s in specs[tail:]]
    return specs


class ScenarioRunner:
    def __init__(self, *, model: str | None, batch_invariant: bool = True, scenario_timeout: float = 300.0) -> None:
        self.model = model
        # Every server computes with batch-invariant kernels, so that a request recomputed after
        # a fault must give the reference's tokens exactly (match_reference).
        self.batch_invariant = batch_invariant
        self.scenario_timeout = scenario_timeout  # a hang fails the scenario instead of the run
        self._references: dict[tuple, list[RequestResult]] = {}
        self._shared_servers: dict[tuple[str, ...], ServerProcess] = {}
        self._adapters = LoRAAdapterFiles(model)

    def _args(self, scenario: Scenario, *, reference: bool = False) -> list[str]:
        args = scenario.reference_args if reference else scenario.server_args
        return ([self.model] if self.model else []) + (["--batch-invariant"] if self.batch_invariant else []) + list(
            args) + self._adapters.server_args(scenario.workload)

    async def _shared_server(self, args: list[str]) -> ServerProcess:
        server = self._shared_servers.get(tuple(args))
        if server is None:
            server = ServerProcess(args)
            self._shared_servers[tuple(args)] = server
            try:
                await server.start()
            except BaseException:
                await self._discard_shared_server(args)
                raise
        return server

    async def _discard_shared_server(self, args: list[str]) -> None:
        """After a failure on it: the next scenario gets a fresh one rather than its debris."""
        server = self._shared_servers.pop(tuple(args), None)
        if server is not None:
            with trio.CancelScope(shield=True):
                await server.stop()

    async def reference(self, scenario: Scenario) -> list[RequestResult]:
        """The same workload on a server without faults."""
        args = self._args(scenario, reference=True)
        key = reference_key(scenario, args)
        if key not in self._references:
            server = await self._shared_server(args)
            workload: Workload = scenario.workload
            self._references[key] = await play(server.base_url, build_requests(workload), workload)
        return self._references[key]

    async def close(self) -> None:
        for args in list(self._shared_servers):
            await self._discard_shared_server(list(args))
        self._adapters.close()

    async def run(self, scenario: Scenario) -> Verdict:
        started = trio.current_time()
        verdict = Verdict(name=scenario.name)
        shared = not scenario.disturbs_server and scenario.server_args == scenario.reference_args
        args = self._args(scenario)
        server: ServerProcess | None = None
        results: list[RequestResult] = []
        reference = None
        code = None
        pids_seen: set[int] = set()
        try:
            with trio.move_on_after(self.scenario_timeout) as limit:
                if scenario.expect.match_reference or scenario.expect.max_p99_ratio is not None:
                    reference = await self.reference(scenario)
                if shared:
                    server = await self._shared_server(args)
                else:
                    server = ServerProcess(args, fault_plan=scenario.fault_plan)
                    await server.start()
                verdict.load_seconds = server.load_seconds
                pids_seen.update(await server.worker_pids())
                before = await server.metrics()
                results = await self._play_with_faults(scenario, server, verdict, pids_seen)
                await check_server_after(scenario, server, verdict, before, pids_seen)
            if limit.cancelled_caught:
                verdict.fail(f"the scenario did not finish within {self.scenario_timeout:.0f}s")
            if not verdict.passed and server is not None:
                verdict.server_log = server.log_tail()
        finally:
            if shared and not verdict.passed:
                await self._discard_shared_server(args)
            elif not shared and server is not None:
                with trio.CancelScope(shield=True):  # never leave a server behind
                    code = await server.stop()
        if scenario.expect.server_exit_code is not None and code != scenario.expect.server_exit_code:
            verdict.fail(f"server exited with {code}, expected {scenario.expect.server_exit_code}")
        # A shared server still runs, and so do its workers; the others must all be gone.
        orphans = [] if shared else [pid for pid in pids_seen if alive(pid)]
        if orphans:
            verdict.fail(f"worker processes left behind: {orphans}")
        judge_requests(scenario, results, reference, verdict)
        verdict.wall_seconds = round(trio.current_time() - started, 1)
        return verdict

    async def _play_with_faults(self, scenario: Scenario, server: ServerProcess, verdict: Verdict,
                                pids_seen: set[int]) -> list[RequestResult]:
        statuses: list[int] = []
        progress = Progress()
        waiting: list[trio.CancelScope] = []
        health_back: list[float] = []
        last_fault: list[float] = []
        start = trio.current_time()

        async def watch_health(since: float) -> None:
            """Time from the fault until /health is 200 again, once it has noticed the fault
            (503 while the workers restart); 0 if it never reports the fault. A server that
            exits meanwhile (a scenario that also stops it) never comes back: no figure."""
            with trio.move_on_after(2.0):
                while True:  # polling another process: there is no event to wait on
                    if await server.health() != 200:
                        break
                    await trio.sleep(0.02)
            while not server.exited:
                if await server.health() == 200:
                    health_back.append(trio.current_time() - since)
                    return
                await trio.sleep(0.05)
            health_back.append(math.inf)

        async def inject(fault) -> None:
            with trio.CancelScope() as trigger:
                waiting.append(trigger)
                if fault.after_tokens is not None:
                    await progress.wait_for(fault.after_tokens)
                    await trio.sleep(fault.at)
                else:
                    await trio.sleep_until(start + fault.at)
            waiting.remove(trigger)
            if trigger.cancelled_caught:
                verdict.fail(f"the {fault.kind} fault never fired: the workload ended first")
                return
            if fault.kind == "sigkill_worker":
                pids_seen.update(await sigkill_worker(server))
                nursery.start_soon(watch_health, trio.current_time())
            elif fault.kind == "sigterm_server":
                server.signal(signal.SIGTERM)
            elif fault.kind == "malformed":
                verdict.malformed_sent += fault.count
                await malformed_burst(server.base_url, fault.count, statuses)
            last_fault.append(trio.current_time())

        async with trio.open_nursery() as nursery:
            for fault in scenario.faults:
                if fault.kind in ("sigkill_worker", "sigterm_server", "malformed"):
                    nursery.start_soon(inject, fault)
            results = await play(server.base_url, _client_specs(scenario), scenario.workload, progress)
            for trigger in list(waiting):
                trigger.cancel()
        if last_fault and scenario.faults_of("sigkill_worker") and math.inf not in health_back:
            verdict.recovery_seconds = round(max(health_back, default=0.0), 2)
            verdict.service_recovery_seconds = service_recovery(results, max(last_fault))
        bad = [s for s in statuses if not 400 <= s < 500]
        if bad:
            verdict.fail(f"{len(bad)} of {len(statuses)} malformed requests got no 4xx: {sorted(set(bad))}")
        return results
