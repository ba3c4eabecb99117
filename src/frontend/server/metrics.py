"""Prometheus metrics for /metrics: one registry per app, names mirroring vLLM's under
``triode:`` so existing dashboards port (same meanings, same histogram buckets, a
``model_name`` label on every series).

Gauges and the engine's own counters are read from ``AsyncLLM.statistics()`` at scrape time;
token counters, finish reasons and latency histograms come from an output observer the engine
calls for every output it delivers (it must not block, and does not). Also exported: the
engine's step count and step time, per rank ``triode:worker_pid``,
``triode:rank_step_seconds_total`` and ``triode:rank_collective_seconds_total`` (the share of
the step a tensor-parallel rank spent in all-reduce and gather; measured inside the workers),
and the server process's own ``process_*`` series."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import attrs
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from triode.engine.engine_stats import EngineStatistics
from triode.engine.outputs import RequestOutput
from triode.engine.sampling_params import OutputKind, SamplingParams

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)
_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
_CLOSED_KEPT = 1024
_MAX_ITL_SAMPLES = 4096  # per non-streamed request, whose gaps are known only on average


@attrs.define
class _Request:
    kind: OutputKind
    n: int
    tokens: dict[int, int] = attrs.Factory(dict)
    reasons: dict[int, str] = attrs.Factory(dict)
    seen: bool = False
    last_token_time: float | None = None


class _EngineCollector:
    def __init__(self, model_name: str, statistics: Callable[[], EngineStatistics | None]) -> None:
        self._model_name = model_name
        self._statistics = statistics

    def collect(self):
        stats = self._statistics()
        if stats is None:
            return
        labels, values = ["model_name"], [self._model_name]
        for name, doc, value in (
            ("triode:num_requests_running", "Sequences in the running batch.", stats.num_running),
            ("triode:num_requests_waiting", "Sequences waiting to be scheduled.", stats.num_waiting),
            ("triode:kv_cache_usage_perc", "KV-cache usage; 1 means 100 percent.", stats.kv_cache_usage),
        ):
            family = GaugeMetricFamily(name, doc, labels=labels)
            family.add_metric(values, value)
            yield family
        pids = GaugeMetricFamily("triode:worker_pid", "Process id of each rank's worker process.",
                                 labels=["model_name", "rank"])
        for rank, pid in enumerate(stats.worker_pids):
            pids.add_metric([self._model_name, str(rank)], pid)
        yield pids
        yield from self._rank_counters(stats)
        for name, doc, value in (
            ("triode:engine_steps", "Model steps executed.", stats.steps),
            ("triode:engine_step_seconds", "Wall time of model steps, as the engine waited for them.",
             stats.step_seconds_total),
            ("triode:num_preemptions", "Preemptions (requests recomputed).", stats.num_preemptions),
            ("triode:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
             stats.prefix_cache_queries),
            ("triode:prefix_cache_hits", "Prompt tokens found in the prefix cache.", stats.prefix_cache_hits),
            ("triode:worker_restarts", "Worker process restarts.", stats.worker_restarts),
        ):
            family = CounterMetricFamily(name, doc, labels=labels)
            family.add_metric(values, value)
            yield family

    def _rank_counters(self, stats: EngineStatistics):
        for name, doc, totals in (
            ("triode:rank_step_seconds", "Step time measured inside each rank's worker.",
             stats.rank_step_seconds_total),
            ("triode:rank_collective_seconds", "Of the step time, all-reduce and logits gather.",
             stats.rank_collective_seconds_total),
        ):
            family = CounterMetricFamily(name, doc, labels=["model_name", "rank"])
            for rank, seconds in enumerate(totals):
                family.add_metric([self._model_name, str(rank)], seconds)
            yield family


class ServerMetrics:
    def __init__(self, model_name: str, statistics: Callable[[], EngineStatistics | None]) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        r, label = self.registry, ["model_name"]
        self.prompt_tokens = Counter("triode:prompt_tokens", "Prefill tokens processed.", label, registry=r)
        self.generation_tokens = Counter("triode:generation_tokens", "Generation tokens produced.", label,
                                         registry=r)
        self.request_success = Counter("triode:request_success", "Finished sequences by finish reason.",
                                       ["model_name", "finished_reason"], registry=r)
        self.ttft = Histogram("triode:time_to_first_token_seconds", "Time to first token.", label,
                              buckets=_TTFT_BUCKETS, registry=r)
        self.itl = Histogram("triode:inter_token_latency_seconds", "Time between output tokens.", label,
                             buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("triode:e2e_request_latency_seconds", "Arrival to finish.", label,
                             buckets=_REQUEST_BUCKETS, registry=r)
        self.queue_time = Histogram("triode:request_queue_time_seconds", "Arrival to first scheduling.",
                                    label, buckets=_REQUEST_BUCKETS, registry=r)
        for reason in ("stop", "length", "abort"):  # every series exists from the first scrape
            self.request_success.labels(model_name, reason)
        for metric in (self.prompt_tokens, self.generation_tokens, self.ttft, self.itl, self.e2e,
                       self.queue_time):
            metric.labels(model_name)
        r.register(_EngineCollector(model_name, statistics))
        ProcessCollector(registry=r)  # process_resident_memory_bytes, CPU seconds, open fds
        self._requests: dict[str, _Request] = {}
        self._closed: deque[str] = deque()

    def render(self) -> bytes:
        return generate_latest(self.registry)

    # ---- triode.engine.async_llm.RequestObserver ----------------------------------------

    def opened(self, request_id: str, params: SamplingParams) -> None:
        self._requests[request_id] = _Request(kind=params.output_kind, n=params.n)

    def closed(self, request_id: str) -> None:
        """The consumer left. The engine still delivers an aborted request's final output a
        step later, so the entry stays until then; entries of requests that never reach the
        engine (rejected in intake) are dropped once the most recent ``_CLOSED_KEPT`` left."""
        if request_id in self._requests:
            self._closed.append(request_id)
            while len(self._closed) > _CLOSED_KEPT:
                self._requests.pop(self._closed.popleft(), None)

    def output(self, output: RequestOutput) -> None:
        state = self._requests.get(output.request_id)
        if state is None:
            return
        name = self.model_name
        metrics = output.metrics
        if not state.seen:
            state.seen = True
            self.prompt_tokens.labels(name).inc(len(output.prompt_token_ids))
            if metrics.first_token_time is not None:
                self.ttft.labels(name).observe(metrics.first_token_time - metrics.arrival_time)
        new_tokens = 0
        for completion in output.outputs:
            count = len(completion.token_ids)
            if state.kind == OutputKind.DELTA:
                new_tokens += count
                state.tokens[completion.index] = state.tokens.get(completion.index, 0) + count
            else:
                new_tokens += count - state.tokens.get(completion.index, 0)
                state.tokens[completion.index] = count
            if completion.finish_reason is not None:
                state.reasons[completion.index] = completion.finish_reason
        if new_tokens:
            self.generation_tokens.labels(name).inc(new_tokens)
        last = metrics.last_token_time
        if state.kind == OutputKind.DELTA and last is not None:
            if state.last_token_time is not None and last > state.last_token_time:
                self.itl.labels(name).observe(last - state.last_token_time)
            state.last_token_time = last
        if output.finished:
            self._finish(output, state)

    def _finish(self, output: RequestOutput, state: _Request) -> None:
        name = self.model_name
        metrics = output.metrics
        del self._requests[output.request_id]
        for index in range(state.n):
            self.request_success.labels(name, state.reasons.get(index, "abort")).inc()
        if metrics.finished_time is not None:
            self.e2e.labels(name).observe(metrics.finished_time - metrics.arrival_time)
        if metrics.first_scheduled_time is not None:
            self.queue_time.labels(name).observe(metrics.first_scheduled_time - metrics.arrival_time)
        steps = max(state.tokens.values(), default=0)
        first, last = metrics.first_token_time, metrics.last_token_time
        if state.kind != OutputKind.DELTA and steps > 1 and first is not None and last is not None:
            gap = (last - first) / (steps - 1)
            histogram = self.itl.labels(name)
            for _ in range(min(steps - 1, _MAX_ITL_SAMPLES)):
                histogram.observe(gap)
