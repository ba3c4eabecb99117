"""Prometheus metrics for /metrics, one registry per app.

Every series that has a vLLM meaning is served under vLLM's name, type, labels, units and
histogram buckets (``vllm:num_requests_running``, ``vllm:kv_cache_usage_perc``,
``vllm:cache_config_info``, ...), labelled ``model_name`` and ``engine`` as vLLM labels them:
the routers that read a server's state (vllm-router, the Gateway API Inference Extension's
endpoint picker, vLLM's production stack) read those names. What only triode has (worker
restarts and pids, each tensor-parallel rank's step and collective time, the engine's steps)
keeps the ``triode:`` prefix. Nothing is served under both names: a scrape every 50 ms (the
endpoint picker's) should not pay for a second copy.

Gauges, the core's counters and its tokens-per-step histogram are read from
``AsyncLLM.statistics()`` at every scrape (``engine_metrics``); the request
histograms are rendered at most once a second (``HISTOGRAM_REFRESH``), since rendering their
buckets is most of a scrape's cost; token counters, finish reasons and the per-request
histograms come from an observer the engine calls for every output it delivers (it must not
block, and does not)."""

from __future__ import annotations

import math
import time
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

from triode.engine.actors.streams import RequestStream
from triode.engine.engine_stats import EngineStatistics
from triode.engine.outputs import EmbeddingRequestOutput, RequestOutput
from triode.engine.pooling_params import PoolingParams
from triode.engine.sampling_params import OutputKind, SamplingParams
from triode.frontend.server.engine_metrics import ENGINE, CacheConfig, EngineCollector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)
_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
_N_BUCKETS = (1, 2, 5, 10, 20)
FINISH_REASONS = ("stop", "length", "abort")
HISTOGRAM_REFRESH = 1.0  # seconds: how stale a scrape's histograms may be
_CLOSED_KEPT = 1024
_MAX_ITL_SAMPLES = 4096  # per non-streamed request, whose gaps are known only on average


def buckets_1_2_5(limit: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``limit`` (vLLM's token-count buckets)."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > limit:
                return tuple(buckets)
            buckets.append(mantissa * scale)
        scale *= 10


@attrs.define
class _Request:
    params: SamplingParams | PoolingParams
    tokens: dict[int, int] = attrs.Factory(dict)
    reasons: dict[int, str] = attrs.Factory(dict)
    prompt_tokens: int = 0
    seen: bool = False
    last_token_time: float | None = None


class ServerMetrics:
    def __init__(self, model_name: str, statistics: Callable[[], EngineStatistics | None], *,
                 cache: CacheConfig, max_model_len: int, max_loras: int | None = None) -> None:
        """``max_model_len`` bounds the token-count histograms' buckets (as in vLLM);
        ``max_loras``: the engine's, where it serves LoRA adapters (vllm:lora_requests_info)."""
        self.model_name = model_name
        # Two registries: what routers read (gauges, counters: a few samples) is rendered at
        # every scrape; the histograms (hundreds of bucket samples, most of a render's cost) at
        # most every HISTOGRAM_REFRESH seconds.
        self.live = live = CollectorRegistry()
        self.histograms = r = CollectorRegistry()
        labels = ["model_name", "engine"]
        self._labels = (model_name, ENGINE)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=r)

        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prefill tokens processed.", labels, registry=live)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generation tokens produced.", labels,
                                         registry=live)
        self.request_success = Counter("vllm:request_success", "Finished sequences by finish reason.",
                                       [*labels, "finished_reason"], registry=live)
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Time to first token.", _TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Time between output tokens.", _ITL_BUCKETS)
        self.tpot = histogram("vllm:request_time_per_output_token_seconds",
                              "Per request, the mean time between its output tokens.", _ITL_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Arrival to finish.", _REQUEST_BUCKETS)
        self.queue_time = histogram("vllm:request_queue_time_seconds", "Arrival to first scheduling.",
                                    _REQUEST_BUCKETS)
        self.prefill_time = histogram("vllm:request_prefill_time_seconds",
                                      "First scheduling to first token.", _REQUEST_BUCKETS)
        self.decode_time = histogram("vllm:request_decode_time_seconds", "First token to finish.",
                                     _REQUEST_BUCKETS)
        self.inference_time = histogram("vllm:request_inference_time_seconds",
                                        "First scheduling to finish.", _REQUEST_BUCKETS)
        token_buckets = buckets_1_2_5(max_model_len)
        self.request_prompt_tokens = histogram("vllm:request_prompt_tokens", "Prompt tokens per request.",
                                               token_buckets)
        self.request_generation_tokens = histogram("vllm:request_generation_tokens",
                                                   "Generated tokens per request.", token_buckets)
        self.request_max_tokens = histogram("vllm:request_params_max_tokens", "The max_tokens of requests.",
                                            token_buckets)
        self.request_n = histogram("vllm:request_params_n", "The n of requests.", _N_BUCKETS)
        for reason in FINISH_REASONS:  # every series exists from the first scrape
            self.request_success.labels(*self._labels, reason)
        for metric in (self.prompt_tokens, self.generation_tokens, self.ttft, self.itl, self.tpot, self.e2e,
                       self.queue_time, self.prefill_time, self.decode_time, self.inference_time,
                       self.request_prompt_tokens, self.request_generation_tokens, self.request_max_tokens,
                       self.request_n):
            metric.labels(*self._labels)
        live.register(EngineCollector(model_name, cache, statistics, max_loras))
        ProcessCollector(registry=live)  # process_resident_memory_bytes, CPU seconds, open fds
        self._requests: dict[RequestStream, _Request] = {}  # a request id may come back: see closed()
        self._closed: deque[RequestStream] = deque()
        self._histograms_text = b""
        self._histograms_at = -math.inf

    def render(self) -> bytes:
        now = time.monotonic()
        if now - self._histograms_at >= HISTOGRAM_REFRESH:
            self._histograms_text, self._histograms_at = generate_latest(self.histograms), now
        return generate_latest(self.live) + self._histograms_text

    # ---- triode.engine.async_llm.RequestObserver ----------------------------------------

    def opened(self, stream: RequestStream, params: SamplingParams | PoolingParams) -> None:
        self._requests[stream] = _Request(params=params)

    def closed(self, stream: RequestStream) -> None:
        """The consumer left. The engine still delivers an aborted request's final output a
        step later, so the entry stays until then, even where a new request took the same
        id; entries of requests that never reach the engine (rejected in intake) are dropped
        once the most recent ``_CLOSED_KEPT`` left."""
        if stream in self._requests:
            self._closed.append(stream)
            while len(self._closed) > _CLOSED_KEPT:
                self._requests.pop(self._closed.popleft(), None)

    def output(self, stream: RequestStream, output: RequestOutput | EmbeddingRequestOutput) -> None:
        state = self._requests.get(stream)
        if state is None:
            return
        if isinstance(output, EmbeddingRequestOutput):
            del self._requests[stream]
            self._embedded(output)
            return
        assert isinstance(state.params, SamplingParams)
        labels = self._labels
        metrics = output.metrics
        delta = state.params.output_kind == OutputKind.DELTA
        if not state.seen:
            state.seen = True
            state.prompt_tokens = len(output.prompt_token_ids)
            self.prompt_tokens.labels(*labels).inc(state.prompt_tokens)
            if metrics.first_token_time is not None:
                self.ttft.labels(*labels).observe(metrics.first_token_time - metrics.arrival_time)
        new_tokens = 0
        for completion in output.outputs:
            count = len(completion.token_ids)
            if delta:
                new_tokens += count
                state.tokens[completion.index] = state.tokens.get(completion.index, 0) + count
            else:
                new_tokens += count - state.tokens.get(completion.index, 0)
                state.tokens[completion.index] = count
            if completion.finish_reason is not None:
                state.reasons[completion.index] = completion.finish_reason
        if new_tokens:
            self.generation_tokens.labels(*labels).inc(new_tokens)
        last = metrics.last_token_time
        if delta and last is not None:
            if state.last_token_time is not None and last > state.last_token_time:
                self.itl.labels(*labels).observe(last - state.last_token_time)
            state.last_token_time = last
        if output.finished:
            del self._requests[stream]
            self._finish(output, state)

    def _embedded(self, output: EmbeddingRequestOutput) -> None:
        """A pooling request: its prompt, its one result, its times (no tokens generated)."""
        labels = self._labels
        prompt_tokens = len(output.prompt_token_ids)
        self.prompt_tokens.labels(*labels).inc(prompt_tokens)
        self.request_prompt_tokens.labels(*labels).observe(prompt_tokens)
        self.request_success.labels(*labels, "stop").inc()
        metrics = output.metrics
        arrival, scheduled, finished = metrics.arrival_time, metrics.first_scheduled_time, metrics.finished_time
        for histogram, start, end in ((self.e2e, arrival, finished), (self.queue_time, arrival, scheduled),
                                      (self.inference_time, scheduled, finished)):
            if start is not None and end is not None:
                histogram.labels(*labels).observe(end - start)

    def _finish(self, output: RequestOutput, state: _Request) -> None:
        labels = self._labels
        metrics = output.metrics
        params = state.params
        assert isinstance(params, SamplingParams)
        for index in range(params.n):
            self.request_success.labels(*labels, state.reasons.get(index, "abort")).inc()
        self.request_prompt_tokens.labels(*labels).observe(state.prompt_tokens)
        self.request_generation_tokens.labels(*labels).observe(sum(state.tokens.values()))
        if params.max_tokens is not None:
            self.request_max_tokens.labels(*labels).observe(params.max_tokens)
        self.request_n.labels(*labels).observe(params.n)
        arrival, scheduled = metrics.arrival_time, metrics.first_scheduled_time
        first, last, finished = metrics.first_token_time, metrics.last_token_time, metrics.finished_time
        for histogram, start, end in (
            (self.e2e, arrival, finished), (self.queue_time, arrival, scheduled),
            (self.prefill_time, scheduled, first), (self.decode_time, first, finished),
            (self.inference_time, scheduled, finished),
        ):
            if start is not None and end is not None:
                histogram.labels(*labels).observe(end - start)
        steps = max(state.tokens.values(), default=0)
        if steps > 1 and first is not None and last is not None:
            gap = (last - first) / (steps - 1)
            self.tpot.labels(*labels).observe(gap)
            if params.output_kind != OutputKind.DELTA:
                histogram = self.itl.labels(*labels)
                for _ in range(min(steps - 1, _MAX_ITL_SAMPLES)):
                    histogram.observe(gap)
