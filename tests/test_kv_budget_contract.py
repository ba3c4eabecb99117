"""Contract tests of the KV cache sized from memory: the default configuration on the default
model holds W1v's 128 sequences at once, and a restarted worker keeps the budget the
scheduler was built for."""

from __future__ import annotations

import os
import signal

import pytest

from triode import EngineArgs, LLMEngine, SamplingParams
from triode.bench.workloads import make_workload

pytestmark = [pytest.mark.contract, pytest.mark.default_model]

GiB = 2**30


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def w1v_blocks(block_size: int) -> int:
    """Blocks W1v's 128 sequences hold at their full lengths."""
    workload = make_workload("W1v")
    assert len(workload.prompts) == 128
    return sum(blocks_for(len(p) + n, block_size) for p, n in zip(workload.prompts, workload.output_lens, strict=True))


def test_the_default_budget_holds_w1v_whole():
    with LLMEngine(EngineArgs()) as engine:
        info = engine.supervisor.info
        assert info is not None and info.kv_cache_memory_bytes > GiB  # the old fixed default
        assert info.kv_cache_sizing.startswith("sized as 0.5 of")
        assert engine.statistics().kv_blocks_total >= w1v_blocks(info.block_size)


@pytest.mark.slow  # 34k prompt tokens: a minute on 2 cores
def test_the_default_configuration_admits_128_w1v_sequences_at_once():
    workload = make_workload("W1v")
    with LLMEngine(EngineArgs()) as engine:
        info = engine.supervisor.info
        for index, (prompt, length) in enumerate(zip(workload.prompts, workload.output_lens, strict=True)):
            engine.add_request(f"w1v-{index}", {"prompt_token_ids": list(prompt)},
                               SamplingParams(temperature=0.0, max_tokens=length, ignore_eos=True))
        for _ in range(64):  # prefill takes about 17 steps of 2048 tokens
            engine.step()
            stats = engine.statistics()
            if stats.num_running == 128:
                break
        assert (stats.num_running, stats.num_waiting, stats.num_preemptions) == (128, 0, 0)
        # Every sequence can grow to its full length without preempting another.
        held = stats.kv_blocks_total - stats.kv_blocks_free
        assert stats.kv_blocks_free >= w1v_blocks(info.block_size) - held
        engine.abort_request([f"w1v-{index}" for index in range(128)])
        assert not engine.has_unfinished_requests()


def test_a_restarted_worker_allocates_the_blocks_the_scheduler_knows():
    with LLMEngine(EngineArgs(max_model_len=512)) as engine:
        before = engine.statistics()
        budget = engine.supervisor.info.kv_cache_memory_bytes
        engine.add_request("a", "Count to twenty:", SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
        engine.step()
        os.kill(before.worker_pids[0], signal.SIGKILL)
        outputs = []
        while engine.has_unfinished_requests():
            outputs.extend(o for o in engine.step() if o.finished)
        after = engine.statistics()
        assert after.worker_restarts == 1
        assert len(outputs) == 1 and len(outputs[0].outputs[0].token_ids) == 24
        assert after.kv_blocks_total == before.kv_blocks_total
        assert engine.supervisor.info.kv_cache_memory_bytes == budget
