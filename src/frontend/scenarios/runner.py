"""Plays scenarios: an undisturbed reference run, then the run with faults, then the verdict."""

from __future__ import annotations

import math
import random
import signal
from collections.abc import Sequence

import attrs
import trio

from frontend.scenarios.client import RequestResult, build_requests, play
from frontend.scenarios.faults import alive, malformed_burst, sigkill_worker
from frontend.scenarios.server import ServerProcess
from frontend.scenarios.spec import Scenario


@attrs.define
class Verdict:
    name: str
    passed: bool = True
    failures: list[str] = attrs.Factory(list)
    requests: int = 0
    lost: int = 0
    mismatched: int = 0
    recovery_seconds: float | None = None  # /health back to 200 after a worker kill
    service_recovery_seconds: float | None = None  # output flowing again after it
    p99_seconds: float | None = None
    reference_p99_seconds: float | None = None
    malformed_sent: int = 0
    worker_restarts: int | None = None
    load_seconds: float = 0.0

    def fail(self, message: str) -> None:
        self.passed = False
        self.failures.append(message)


def _service_recovery(results, fault_time: float) -> float:
    """Seconds from the fault until output flowed again to any client."""
    after = [t for r in results for t in r.progress_times if t > fault_time]
    return round(min(after) - fault_time, 2) if after else 0.0


def p99(values: Sequence[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]


class ScenarioRunner:
    def __init__(self, *, model: str | None) -> None:
        self.model = model
        self._references: dict[tuple, list[RequestResult]] = {}
        self._reference_servers: dict[tuple, ServerProcess] = {}

    def _args(self, scenario: Scenario, *, reference: bool = False) -> list[str]:
        args = scenario.reference_args if reference else scenario.server_args
        return ([self.model] if self.model else []) + list(args)

    async def reference(self, scenario: Scenario) -> list[RequestResult]:
        """The same workload on a server without faults. Reference servers stay up for the
        runner's lifetime and serve every scenario with the same reference arguments."""
        args = self._args(scenario, reference=True)
        key = (tuple(args), scenario.workload)
        if key not in self._references:
            server = self._reference_servers.get(tuple(args))
            if server is None:
                server = ServerProcess(args)
                self._reference_servers[tuple(args)] = server
                await server.start()
            self._references[key] = await play(server.base_url, build_requests(scenario.workload), scenario.workload)
        return self._references[key]

    async def close(self) -> None:
        for server in self._reference_servers.values():
            await server.stop()
        self._reference_servers.clear()

    async def run(self, scenario: Scenario) -> Verdict:
        verdict = Verdict(name=scenario.name)
        expect = scenario.expect
        reference = None
        if expect.match_reference or expect.max_p99_ratio is not None:
            reference = await self.reference(scenario)
        args = self._args(scenario)
        if scenario.fault_plan:
            args += ["--fault-plan", scenario.fault_plan]
        server = ServerProcess(args)
        try:
            await server.start()
        except BaseException:
            await server.stop()
            raise
        verdict.load_seconds = server.load_seconds
        pids_seen = set(await server.worker_pids())
        rss_before = (await server.metrics()).get("process_resident_memory_bytes")
        specs = build_requests(scenario.workload)
        rng = random.Random(scenario.workload.seed)
        for fault in scenario.faults_of("disconnect"):
            specs[: fault.clients] = [
                attrs.evolve(s, disconnect_after=rng.randint(1, fault.after_chunks)) for s in specs[: fault.clients]
            ]
        for fault in scenario.faults_of("slow_reader"):
            tail = len(specs) - fault.clients
            specs[tail:] = [attrs.evolve(s, read_interval=fault.chunk_interval) for s in specs[tail:]]
        statuses: list[int] = []
        last_fault = {"time": None}
        start = trio.current_time()

        health_back: list[float] = []

        async def watch_health(since: float) -> None:
            """Time from the fault until /health is 200 again, once it has noticed the fault
            (503 while the workers restart); 0 if it never reports the fault."""
            with trio.move_on_after(2.0):
                while True:  # polling another process: there is no event to wait on
                    if await server.health() != 200:
                        break
                    await trio.sleep(0.02)
            while True:
                if await server.health() == 200:
                    health_back.append(trio.current_time() - since)
                    return
                await trio.sleep(0.05)

        async def inject(fault) -> None:
            await trio.sleep_until(start + fault.at)
            if fault.kind == "sigkill_worker":
                pids_seen.update(await sigkill_worker(server))
                nursery.start_soon(watch_health, trio.current_time())
            elif fault.kind == "sigterm_server":
                server.signal(signal.SIGTERM)
            elif fault.kind == "malformed":
                verdict.malformed_sent += fault.count
                await malformed_burst(server.base_url, fault.count, statuses)
            last_fault["time"] = trio.current_time()

        try:
            async with trio.open_nursery() as nursery:
                for fault in scenario.faults:
                    if fault.kind in ("sigkill_worker", "sigterm_server", "malformed"):
                        nursery.start_soon(inject, fault)
                results = await play(server.base_url, specs, scenario.workload)
            if last_fault["time"] is not None and scenario.faults_of("sigkill_worker"):
                verdict.recovery_seconds = round(max(health_back, default=0.0), 2)
                verdict.service_recovery_seconds = _service_recovery(results, last_fault["time"])
            await self._check_server_after(scenario, server, verdict, pids_seen, rss_before)
        finally:
            code = await server.stop()
        if expect.server_exit_code is not None and code != expect.server_exit_code:
            verdict.fail(f"server exited with {code}, expected {expect.server_exit_code}")
        orphans = [pid for pid in pids_seen if alive(pid)]
        if orphans:
            verdict.fail(f"worker processes left behind: {orphans}")
        self._judge_requests(scenario, results, reference, verdict)
        bad = [s for s in statuses if not 400 <= s < 500]
        if bad:
            verdict.fail(f"{len(bad)} of {len(statuses)} malformed requests got no 4xx: {sorted(set(bad))}")
        return verdict

    async def _check_server_after(self, scenario, server, verdict, pids_seen, rss_before) -> None:
        expect = scenario.expect
        if scenario.faults_of("sigterm_server"):
            await server.wait(120.0)
            return  # the scenario stops the server; what remains is its exit code
        bound = expect.health_within
        if expect.health_within_load_plus is not None:
            bound = server.load_seconds + expect.health_within_load_plus
        if bound is not None and verdict.recovery_seconds is not None and verdict.recovery_seconds > bound:
            verdict.fail(f"/health took {verdict.recovery_seconds:.1f}s to return to 200 (bound {bound:.1f}s)")
        health = await server.health()
        if health != expect.health_at_end:
            verdict.fail(f"/health is {health} at the end, expected {expect.health_at_end}")
        if health != 200:
            return
        metrics = await server.metrics()
        pids_seen.update(await server.worker_pids())
        if expect.kv_free_at_end and metrics.get("triode:kv_cache_usage_perc", 0.0) != 0.0:
            verdict.fail(f"KV cache usage {metrics['triode:kv_cache_usage_perc']} at the end, expected 0")
        if metrics.get("triode:num_requests_running", 0) or metrics.get("triode:num_requests_waiting", 0):
            verdict.fail("requests still running or waiting at the end")
        rss_after = metrics.get("process_resident_memory_bytes")
        if expect.max_rss_growth_mb is not None and rss_before and rss_after:
            growth = (rss_after - rss_before) / 2**20
            if growth > expect.max_rss_growth_mb:
                verdict.fail(f"server memory grew {growth:.0f} MiB (bound {expect.max_rss_growth_mb} MiB)")
        verdict.worker_restarts = int(metrics.get("triode:worker_restarts_total", 0))
        if verdict.worker_restarts < expect.min_worker_restarts:
            verdict.fail(f"{verdict.worker_restarts} worker restarts, expected at least {expect.min_worker_restarts}")
        preemptions = metrics.get("triode:num_preemptions_total", 0)
        if preemptions < expect.min_preemptions:
            verdict.fail(f"{preemptions:.0f} preemptions, expected at least {expect.min_preemptions}")

    def _judge_requests(self, scenario: Scenario, results, reference, verdict: Verdict) -> None:
        expect = scenario.expect
        verdict.requests = len(results)
        latencies = []
        lost_examples: list[str] = []
        for result in results:
            if result.disconnected:
                continue
            if result.status != 200:
                if result.status not in expect.statuses:
                    verdict.fail(f"request {result.index}: status {result.status} ({result.error})")
                continue
            normal = result.error is None and result.finish_reason in expect.finish_reasons
            allowed_error = result.error is not None and any(e in result.error for e in expect.errors)
            if not normal and not allowed_error:
                verdict.lost += 1
                if len(lost_examples) < 3:
                    lost_examples.append(f"#{result.index}: finish={result.finish_reason} error={result.error}")
                continue
            if normal:
                if not result.slow:
                    latencies.append(result.latency)
                if expect.match_reference and reference is not None:
                    twin = reference[result.index]
                    if (twin.text, twin.finish_reason) != (result.text, result.finish_reason):
                        verdict.mismatched += 1
        if verdict.lost:
            verdict.fail(f"{verdict.lost} accepted requests ended without a normal finish or an expected "
                         f"error, e.g. {'; '.join(lost_examples)}")
        if verdict.mismatched:
            verdict.fail(f"{verdict.mismatched} outputs differ from the undisturbed run")
        verdict.p99_seconds = p99(latencies)
        if reference is not None:
            verdict.reference_p99_seconds = p99([r.latency for r in reference if r.status == 200])
        if expect.max_p99_ratio is not None and verdict.p99_seconds and verdict.reference_p99_seconds:
            ratio = verdict.p99_seconds / verdict.reference_p99_seconds
            if ratio > expect.max_p99_ratio:
                verdict.fail(f"p99 latency {ratio:.1f}x the undisturbed run (bound {expect.max_p99_ratio}x)")
