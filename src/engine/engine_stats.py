"""The engine's statistics record, one shape for every entry layer (and /metrics)."""

from __future__ import annotations

import attrs

from triode.engine.actors.supervisor import WorkerSupervisor
from triode.engine.core.engine_core import EngineCore
from triode.engine.spec_decode.policy import SpecDecodeStats


@attrs.frozen(kw_only=True)
class EngineStatistics:
    kv_blocks_total: int
    kv_blocks_free: int
    num_running: int
    num_waiting: int
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    worker_restarts: int
    worker_pids: tuple[int, ...]
    steps: int
    step_seconds_total: float
    worker_idle_seconds: float  # between steps while requests were unfinished
    tensor_parallel_size: int = 1
    # Per tensor-parallel rank (rank order), measured inside the workers: step time and, of it,
    # collective time (all-reduce + logits gather), totals and last step; peak RSS after load.
    rank_step_seconds_total: tuple[float, ...] = ()
    rank_collective_seconds_total: tuple[float, ...] = ()
    rank_last_step_seconds: tuple[float, ...] = ()
    rank_last_collective_seconds: tuple[float, ...] = ()
    rank_peak_rss_bytes: tuple[int | None, ...] = ()
    grammar_seconds_total: float = 0.0  # of the step time, structured outputs' masks (rank 0)
    # of the step time, rank 0's host work around the forward (plan, inputs, sampler tensors)
    worker_prepare_seconds_total: float = 0.0
    # the engine process's own work: scheduling, applying results, detokenizing and outputs
    engine_seconds_total: float = 0.0
    # of engine_seconds_total: planning steps (and handing them to the workers' thread), and
    # applying results and building outputs; of the latter, applying results (before the next
    # step is sent) and the tokenizer's decoding (beside it)
    schedule_seconds_total: float = 0.0
    output_seconds_total: float = 0.0
    apply_seconds_total: float = 0.0
    detokenize_seconds_total: float = 0.0
    # pickling plans, and unpickling results (of step_seconds_total), in the engine's trio thread
    plan_encode_seconds_total: float = 0.0
    result_decode_seconds_total: float = 0.0
    # of the step time (rank 0): the model's forward, and sampling
    worker_forward_seconds_total: float = 0.0
    worker_sample_seconds_total: float = 0.0
    # steps by tokens fed, per bucket of ITERATION_TOKEN_BUCKETS (the last: above them all)
    iteration_tokens: tuple[int, ...] = ()
    iteration_tokens_sum: int = 0
    # the LoRA adapters of the running and the waiting sequences, by name
    running_lora_adapters: tuple[str, ...] = ()
    waiting_lora_adapters: tuple[str, ...] = ()
    # speculative decoding's counters (vllm:spec_decode_*), with a speculative config
    spec_decode: SpecDecodeStats | None = None

    @property
    def kv_cache_usage(self) -> float:
        return 1.0 - self.kv_blocks_free / self.kv_blocks_total if self.kv_blocks_total else 0.0


def collect_statistics(
    engine_core: EngineCore, supervisor: WorkerSupervisor, *, output_seconds: float, detokenize_seconds: float,
) -> EngineStatistics:
    """``output_seconds``: the driver's time building outputs (the core's own time, planning
    steps and applying results, it keeps itself)."""
    core = engine_core.statistics()
    schedule_seconds = engine_core.schedule_seconds
    output_seconds += engine_core.apply_seconds
    workers = supervisor.statistics()
    return EngineStatistics(
        kv_blocks_total=core.kv_blocks_total,
        kv_blocks_free=core.kv_blocks_free,
        num_running=core.num_running,
        num_waiting=core.num_waiting,
        num_preemptions=core.num_preemptions,
        prefix_cache_queries=core.prefix_cache_queries,
        prefix_cache_hits=core.prefix_cache_hits,
        worker_restarts=workers.worker_restarts,
        worker_pids=workers.worker_pids,
        steps=workers.steps,
        step_seconds_total=workers.step_seconds_total,
        worker_idle_seconds=engine_core.idle_seconds,
        tensor_parallel_size=workers.tensor_parallel_size,
        rank_step_seconds_total=workers.rank_step_seconds_total,
        rank_collective_seconds_total=workers.rank_collective_seconds_total,
        rank_last_step_seconds=workers.rank_last_step_seconds,
        rank_last_collective_seconds=workers.rank_last_collective_seconds,
        rank_peak_rss_bytes=workers.rank_peak_rss_bytes,
        grammar_seconds_total=workers.grammar_seconds_total,
        worker_prepare_seconds_total=workers.prepare_seconds_total,
        engine_seconds_total=schedule_seconds + output_seconds,
        schedule_seconds_total=schedule_seconds,
        output_seconds_total=output_seconds,
        apply_seconds_total=engine_core.apply_seconds,
        detokenize_seconds_total=detokenize_seconds,
        plan_encode_seconds_total=workers.encode_seconds_total,
        result_decode_seconds_total=workers.decode_seconds_total,
        worker_forward_seconds_total=workers.forward_seconds_total,
        worker_sample_seconds_total=workers.sample_seconds_total,
        iteration_tokens=core.iteration_tokens,
        iteration_tokens_sum=core.iteration_tokens_sum,
        running_lora_adapters=core.running_lora_adapters,
        waiting_lora_adapters=core.waiting_lora_adapters,
        spec_decode=core.spec_decode,
    )
