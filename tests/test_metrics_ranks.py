"""Unit test of /metrics' per-rank series: ServerMetrics rendered from a statistics record
of a two-rank engine, no server."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from triode.engine.engine_stats import EngineStatistics
from triode.frontend.server.metrics import ServerMetrics


def _two_rank_statistics() -> EngineStatistics:
    return EngineStatistics(
        kv_blocks_total=100, kv_blocks_free=75, num_running=2, num_waiting=1, num_preemptions=0,
        prefix_cache_queries=0, prefix_cache_hits=0, worker_restarts=1, worker_pids=(4242,), steps=12,
        step_seconds_total=3.5, worker_idle_seconds=0.0, tensor_parallel_size=2,
        rank_step_seconds_total=(3.25, 3.0), rank_collective_seconds_total=(0.5, 0.75),
        rank_last_step_seconds=(0.25, 0.25), rank_last_collective_seconds=(0.0, 0.0),
    )


def test_every_rank_reports_its_step_and_collective_seconds():
    metrics = ServerMetrics("m", _two_rank_statistics)
    samples = {
        (sample.name, sample.labels.get("rank")): sample.value
        for family in text_string_to_metric_families(metrics.render().decode())
        for sample in family.samples
    }
    assert samples["triode:rank_step_seconds_total", "0"] == 3.25
    assert samples["triode:rank_step_seconds_total", "1"] == 3.0
    assert samples["triode:rank_collective_seconds_total", "1"] == 0.75
    assert samples["triode:engine_steps_total", None] == 12
    assert samples["triode:engine_step_seconds_total", None] == 3.5
    assert samples["triode:kv_cache_usage_perc", None] == 0.25
