"""The engine's series on /metrics, read from ``AsyncLLM.statistics()`` at every scrape (what
routers read is never stale): its queues, KV cache and prefix cache, the tokens per step, the
LoRA adapters and speculative decoding under vLLM's names; worker restarts and pids, each
tensor-parallel rank's step and collective time, and the engine's steps under ``triode:``."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import attrs
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from triode.engine.core.scheduler_output import ITERATION_TOKEN_BUCKETS
from triode.engine.engine_stats import EngineStatistics
from triode.engine.spec_decode.policy import SpecDecodeStats

ENGINE = "0"  # vLLM's engine label: the data-parallel engine's index; a triode server runs one


@attrs.frozen(kw_only=True)
class CacheConfig:
    """What ``vllm:cache_config_info`` labels (vLLM's CacheConfig fields that triode has)."""

    block_size: int
    enable_prefix_caching: bool
    kv_cache_memory_bytes: int
    cache_dtype: str = "auto"  # the model's dtype, as vLLM's "auto"


class EngineCollector:
    """A prometheus_client collector of the engine's statistics (None before it first ran)."""

    def __init__(self, model_name: str, cache: CacheConfig,
                 statistics: Callable[[], EngineStatistics | None], max_loras: int | None) -> None:
        self._labels = [model_name, ENGINE]
        self._cache = cache
        self._max_loras = max_loras
        self._statistics = statistics

    def collect(self) -> Iterator[Metric]:
        stats = self._statistics()
        if stats is None:
            return
        names, values = ["model_name", "engine"], self._labels
        for kind, name, doc, value in (
            (GaugeMetricFamily, "vllm:num_requests_running", "Sequences in the running batch.", stats.num_running),
            (GaugeMetricFamily, "vllm:num_requests_waiting", "Sequences waiting to be scheduled.",
             stats.num_waiting),
            (GaugeMetricFamily, "vllm:kv_cache_usage_perc", "KV-cache usage; 1 means 100 percent.",
             stats.kv_cache_usage),
            (CounterMetricFamily, "vllm:num_preemptions", "Preemptions (sequences recomputed).",
             stats.num_preemptions),
            (CounterMetricFamily, "vllm:prefix_cache_queries", "Tokens looked up in the prefix cache.",
             stats.prefix_cache_queries),
            (CounterMetricFamily, "vllm:prefix_cache_hits", "Tokens found in the prefix cache.",
             stats.prefix_cache_hits),
            (CounterMetricFamily, "triode:engine_steps", "Model steps executed.", stats.steps),
            (CounterMetricFamily, "triode:engine_step_seconds",
             "Wall time of model steps, as the engine waited for them.", stats.step_seconds_total),
            (CounterMetricFamily, "triode:worker_restarts", "Worker process restarts.", stats.worker_restarts),
        ):
            family = kind(name, doc, labels=names)
            family.add_metric(values, value)
            yield family
        yield self._cache_config_info(stats)
        if self._max_loras is not None:
            yield self._lora_requests_info(stats)
        yield self._iteration_tokens(stats)
        if stats.spec_decode is not None:
            yield from self._spec_decode(stats.spec_decode)
        pids = GaugeMetricFamily("triode:worker_pid", "Process id of each rank's worker process.",
                                 labels=["model_name", "engine", "rank"])
        for rank, pid in enumerate(stats.worker_pids):
            pids.add_metric([*values, str(rank)], pid)
        yield pids
        for name, doc, totals in (
            ("triode:rank_step_seconds", "Step time measured inside each rank's worker.",
             stats.rank_step_seconds_total),
            ("triode:rank_collective_seconds", "Of the step time, all-reduce and logits gather.",
             stats.rank_collective_seconds_total),
        ):
            family = CounterMetricFamily(name, doc, labels=["model_name", "engine", "rank"])
            for rank, seconds in enumerate(totals):
                family.add_metric([*values, str(rank)], seconds)
            yield family

    def _cache_config_info(self, stats: EngineStatistics) -> GaugeMetricFamily:
        cache = self._cache
        labels = {
            "block_size": str(cache.block_size), "cache_dtype": cache.cache_dtype,
            "enable_prefix_caching": str(cache.enable_prefix_caching),
            "kv_cache_memory_bytes": str(cache.kv_cache_memory_bytes),
            "num_cpu_blocks": "None", "num_gpu_blocks": str(stats.kv_blocks_total), "engine": ENGINE,
        }
        family = GaugeMetricFamily("vllm:cache_config_info", "Information of the KV cache's configuration.",
                                   labels=list(labels))
        family.add_metric(list(labels.values()), 1.0)
        return family

    def _lora_requests_info(self, stats: EngineStatistics) -> GaugeMetricFamily:
        """vLLM's adapter-affinity gauge: which adapters have running and waiting requests
        (names joined by commas), its value the time of the reading, as vLLM sets it."""
        family = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on lora requests.",
                                   labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"])
        family.add_metric([str(self._max_loras), ",".join(stats.waiting_lora_adapters),
                           ",".join(stats.running_lora_adapters)], time.time())
        return family

    def _spec_decode(self, spec: SpecDecodeStats) -> Iterator[Metric]:
        """vLLM's speculative-decoding counters; per position, how often the proposed token
        there was accepted (label ``position``, from 0)."""
        names = ["model_name", "engine"]
        for name, doc, value in (
            ("vllm:spec_decode_num_drafts", "Verifications of proposed tokens.", spec.num_drafts),
            ("vllm:spec_decode_num_draft_tokens", "Proposed tokens verified.", spec.num_draft_tokens),
            ("vllm:spec_decode_num_accepted_tokens", "Proposed tokens accepted.", spec.num_accepted_tokens),
        ):
            family = CounterMetricFamily(name, doc, labels=names)
            family.add_metric(self._labels, value)
            yield family
        family = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                     "Proposed tokens accepted, by position.", labels=[*names, "position"])
        for position, count in enumerate(spec.accepted_per_position):
            family.add_metric([*self._labels, str(position)], count)
        yield family

    def _iteration_tokens(self, stats: EngineStatistics) -> HistogramMetricFamily:
        counts = stats.iteration_tokens or (0,) * (len(ITERATION_TOKEN_BUCKETS) + 1)
        cumulative, total = [], 0
        for bound, count in zip((*(str(float(b)) for b in ITERATION_TOKEN_BUCKETS), "+Inf"), counts, strict=True):
            total += count
            cumulative.append((bound, total))
        family = HistogramMetricFamily("vllm:iteration_tokens_total", "Tokens fed per engine step.",
                                       labels=["model_name", "engine"])
        family.add_metric(self._labels, cumulative, sum_value=stats.iteration_tokens_sum)
        return family
