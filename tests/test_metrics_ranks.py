"""Unit tests of /metrics rendered by ServerMetrics from a statistics record, no server: the
per-rank series of a two-rank engine, the tokens-per-step histogram, the refresh of the
histograms, and speculative decoding's counters; and the requests' counters, each request
counted once even where a new one takes the id of one the engine is still aborting."""

from __future__ import annotations

import attrs
from prometheus_client.parser import text_string_to_metric_families

from triode.engine.actors.streams import RequestStream
from triode.engine.engine_stats import EngineStatistics
from triode.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from triode.engine.sampling_params import OutputKind, SamplingParams
from triode.engine.spec_decode.policy import SpecDecodeStats
from triode.frontend.server.engine_metrics import CacheConfig
from triode.frontend.server.metrics import ServerMetrics


def _two_rank_statistics() -> EngineStatistics:
    return EngineStatistics(
        kv_blocks_total=100, kv_blocks_free=75, num_running=2, num_waiting=1, num_preemptions=0,
        prefix_cache_queries=0, prefix_cache_hits=0, worker_restarts=1, worker_pids=(4242,), steps=12,
        step_seconds_total=3.5, worker_idle_seconds=0.0, tensor_parallel_size=2,
        rank_step_seconds_total=(3.25, 3.0), rank_collective_seconds_total=(0.5, 0.75),
        rank_last_step_seconds=(0.25, 0.25), rank_last_collective_seconds=(0.0, 0.0),
        # 3 steps of 1 token, 2 of 9..16, 1 above 16384
        iteration_tokens=(3, 0, 2) + (0,) * 10 + (1,), iteration_tokens_sum=3 + 25 + 20000,
    )


def _samples(metrics: ServerMetrics, label: str) -> dict[tuple[str, str | None], float]:
    """Every sample /metrics renders, by name and the value of one of its labels."""
    return {(sample.name, sample.labels.get(label)): sample.value
            for family in text_string_to_metric_families(metrics.render().decode()) for sample in family.samples}


def test_every_rank_reports_its_step_and_collective_seconds():
    metrics = ServerMetrics("m", _two_rank_statistics, max_model_len=512,
                            cache=CacheConfig(block_size=16, enable_prefix_caching=True, kv_cache_memory_bytes=2**20))
    samples = _samples(metrics, "rank")
    assert samples["triode:rank_step_seconds_total", "0"] == 3.25
    assert samples["triode:rank_step_seconds_total", "1"] == 3.0
    assert samples["triode:rank_collective_seconds_total", "1"] == 0.75
    assert samples["triode:engine_steps_total", None] == 12
    assert samples["triode:engine_step_seconds_total", None] == 3.5
    assert samples["vllm:kv_cache_usage_perc", None] == 0.25


def test_tokens_per_step_are_a_cumulative_histogram_with_vllms_bounds():
    metrics = ServerMetrics("m", _two_rank_statistics, max_model_len=512,
                            cache=CacheConfig(block_size=16, enable_prefix_caching=True, kv_cache_memory_bytes=2**20))
    (family,) = [f for f in text_string_to_metric_families(metrics.render().decode())
                 if f.name == "vllm:iteration_tokens_total"]
    assert family.type == "histogram"
    buckets = [(s.labels["le"], s.value) for s in family.samples if s.name.endswith("_bucket")]
    assert len(buckets) == 14
    assert buckets[:3] == [("1.0", 3), ("8.0", 3), ("16.0", 5)]
    assert buckets[-2:] == [("16384.0", 5), ("+Inf", 6)]
    totals = {s.name.rsplit("_", 1)[1]: s.value for s in family.samples if not s.name.endswith("_bucket")}
    assert totals == {"count": 6, "sum": 20028}


def test_gauges_are_fresh_at_every_scrape_and_histograms_within_a_second(monkeypatch):
    from triode.frontend.server import metrics as metrics_module

    now = [1000.0]
    monkeypatch.setattr(metrics_module.time, "monotonic", lambda: now[0])
    running = [2]

    def statistics() -> EngineStatistics:
        return attrs.evolve(_two_rank_statistics(), num_running=running[0])

    metrics = ServerMetrics("m", statistics, max_model_len=512,
                            cache=CacheConfig(block_size=16, enable_prefix_caching=True, kv_cache_memory_bytes=2**20))

    def scrape() -> dict[str, float]:
        return {s.name: s.value for f in text_string_to_metric_families(metrics.render().decode()) for s in f.samples}

    assert scrape()["vllm:time_to_first_token_seconds_count"] == 0
    running[0] = 7
    metrics.ttft.labels("m", "0").observe(0.5)
    samples = scrape()
    assert samples["vllm:num_requests_running"] == 7  # fresh
    assert samples["vllm:time_to_first_token_seconds_count"] == 0  # rendered less than a second ago
    now[0] += metrics_module.HISTOGRAM_REFRESH
    assert scrape()["vllm:time_to_first_token_seconds_count"] == 1


def test_speculative_decoding_counters_are_vllms():
    spec = SpecDecodeStats(num_drafts=7, num_draft_tokens=20, num_accepted_tokens=12, accepted_per_position=(6, 4, 2))
    statistics = attrs.evolve(_two_rank_statistics(), spec_decode=spec)
    metrics = ServerMetrics("m", lambda: statistics, max_model_len=512,
                            cache=CacheConfig(block_size=16, enable_prefix_caching=True, kv_cache_memory_bytes=2**20))
    samples = _samples(metrics, "position")
    assert samples["vllm:spec_decode_num_drafts_total", None] == 7
    assert samples["vllm:spec_decode_num_draft_tokens_total", None] == 20
    assert samples["vllm:spec_decode_num_accepted_tokens_total", None] == 12
    per_position = {p: v for (name, p), v in samples.items() if name == "vllm:spec_decode_num_accepted_tokens_per_pos_total"}
    assert per_position == {"0": 6, "1": 4, "2": 2}
    # an engine without a speculative config serves none of them
    plain = ServerMetrics("m", _two_rank_statistics, max_model_len=512,
                          cache=CacheConfig(block_size=16, enable_prefix_caching=True, kv_cache_memory_bytes=2**20))
    assert "spec_decode" not in plain.render().decode()


def _output(tokens: int, finish_reason: str | None) -> RequestOutput:
    return RequestOutput(
        request_id="same", prompt=None, prompt_token_ids=(1, 2, 3), prompt_logprobs=None,
        outputs=(CompletionOutput(index=0, text="", token_ids=(7,) * tokens, finish_reason=finish_reason),),
        finished=finish_reason is not None, metrics=RequestMetrics(arrival_time=0.0),
    )


def test_a_request_id_used_again_while_the_engine_aborts_the_first_counts_each_once():
    """Found by probing: a client left a stream, another took its X-Request-Id at once, and
    the first's abort (delivered a step later) was counted as the second's end; the second's
    own outputs were then dropped."""
    metrics = ServerMetrics("m", lambda: None, max_model_len=512,
                            cache=CacheConfig(block_size=16, enable_prefix_caching=True, kv_cache_memory_bytes=2**20))
    params = SamplingParams(max_tokens=4, output_kind=OutputKind.DELTA)
    first, second = RequestStream("same", OutputKind.DELTA), RequestStream("same", OutputKind.DELTA)
    metrics.opened(first, params)
    metrics.output(first, _output(2, None))
    metrics.closed(first)  # the consumer left; the id is free
    metrics.opened(second, params)
    metrics.output(first, _output(0, "abort"))  # the engine's abort of the first
    for finish_reason in (None, None, None, "length"):
        metrics.output(second, _output(1, finish_reason))
    samples = _samples(metrics, "finished_reason")
    assert samples["vllm:request_success_total", "abort"] == 1
    assert samples["vllm:request_success_total", "length"] == 1
    assert samples["vllm:generation_tokens_total", None] == 2 + 4
    assert samples["vllm:prompt_tokens_total", None] == 2 * 3
