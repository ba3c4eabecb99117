"""The verdict on one scenario run: what the requests got, and the state the server was left in."""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs
import trio

from triode.scenarios.client import RequestResult
from triode.scenarios.server import ServerProcess
from triode.scenarios.spec import Scenario


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
    # Model steps the run took: unlike latency, a busy machine does not change it, so it tells
    # slow work apart from a slow machine.
    engine_steps: int | None = None
    wall_seconds: float = 0.0  # the whole scenario, its reference run and server start-up included
    server_log: str = ""  # the server's last lines, kept when the scenario fails

    def fail(self, message: str) -> None:
        self.passed = False
        self.failures.append(message)


def service_recovery(results: Sequence[RequestResult], fault_time: float) -> float:
    """Seconds from the fault until output flowed again to any client."""
    after = [t for r in results for t in r.progress_times if t > fault_time]
    return round(min(after) - fault_time, 2) if after else 0.0


def p99(values: Sequence[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]


async def check_server_after(scenario: Scenario, server: ServerProcess, verdict: Verdict,
                             before: dict[str, float], pids_seen: set[int]) -> None:
    """The server's state once the workload is over. Counters are taken relative to
    ``before``, the metrics at the start, since a shared server has served other scenarios."""
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
    if health == 200:
        metrics = await _settled_metrics(server)
        pids_seen.update(await server.worker_pids())
    else:  # the engine has ended: /metrics keeps its series, with nothing running
        metrics = await server.metrics()
        if "triode:engine_steps_total" not in metrics:
            verdict.fail("the engine's series left /metrics when it ended")
    if expect.kv_free_at_end and metrics.get("vllm:kv_cache_usage_perc", 0.0) != 0.0:
        verdict.fail(f"KV cache usage {metrics['vllm:kv_cache_usage_perc']} at the end, expected 0")
    if metrics.get("vllm:num_requests_running", 0) or metrics.get("vllm:num_requests_waiting", 0):
        verdict.fail("requests still running or waiting at the end")
    rss_before, rss_after = before.get("process_resident_memory_bytes"), metrics.get("process_resident_memory_bytes")
    if expect.max_rss_growth_mb is not None and rss_before and rss_after:
        growth = (rss_after - rss_before) / 2**20
        if growth > expect.max_rss_growth_mb:
            verdict.fail(f"server memory grew {growth:.0f} MiB (bound {expect.max_rss_growth_mb} MiB)")

    def grown(name: str) -> float:
        return metrics.get(name, 0.0) - before.get(name, 0.0)

    verdict.engine_steps = int(grown("triode:engine_steps_total"))
    verdict.worker_restarts = int(grown("triode:worker_restarts_total"))
    if verdict.worker_restarts < expect.min_worker_restarts:
        verdict.fail(f"{verdict.worker_restarts} worker restarts, expected at least {expect.min_worker_restarts}")
    preemptions = grown("vllm:num_preemptions_total")
    if preemptions < expect.min_preemptions:
        verdict.fail(f"{preemptions:.0f} preemptions, expected at least {expect.min_preemptions}")


async def _settled_metrics(server: ServerProcess, *, limit: float = 10.0) -> dict[str, float]:
    """The metrics once no request runs or waits, or after ``limit`` seconds. A client that
    just left is aborted before the engine's next step, not at once: give that step time,
    but not so much that a request or block really left behind would go unseen."""
    with trio.move_on_after(limit):
        while True:  # polling another process: there is no event to wait on
            metrics = await server.metrics()
            busy = (metrics.get("vllm:num_requests_running", 0) + metrics.get("vllm:num_requests_waiting", 0)
                    + metrics.get("vllm:kv_cache_usage_perc", 0.0))
            if not busy:
                return metrics
            await trio.sleep(0.05)
    return await server.metrics()


def judge_requests(scenario: Scenario, results: Sequence[RequestResult],
                   reference: Sequence[RequestResult] | None, verdict: Verdict) -> None:
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
