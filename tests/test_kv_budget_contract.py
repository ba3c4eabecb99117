"""Contract tests of the KV cache sized from memory: the default configuration on the default
model holds W1v's 128 sequences at once, a restarted worker keeps the budget the scheduler was
built for, and a given budget past the machine's memory stops the start."""

from __future__ import annotations

import os
import signal

import pytest

from triode import EngineArgs, KVCacheTooLargeError, LLMEngine, SamplingParams
from triode.bench.workloads import make_workload
from triode.engine.worker.kv_budget import read_memory

pytestmark = [pytest.mark.contract, pytest.mark.default_model]

GiB = 2**30


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def w1v_blocks(block_size: int, vocab_size: int) -> int:
    """Blocks W1v's 128 sequences hold at their full lengths."""
    workload = make_workload("W1v", vocab_size=vocab_size)
    assert len(workload.prompts) == 128
    return sum(blocks_for(len(p) + n, block_size) for p, n in zip(workload.prompts, workload.output_lens, strict=True))


def test_the_default_budget_holds_w1v_whole():
    with LLMEngine(EngineArgs()) as engine:
        info = engine.supervisor.info
        assert info is not None and info.kv_cache_memory_bytes > GiB  # the old fixed default
        assert info.kv_cache_sizing.startswith("sized as 0.5 of")
        assert engine.statistics().kv_blocks_total >= w1v_blocks(info.block_size, engine.vocab_size)


@pytest.mark.slow  # 34k prompt tokens: a minute on 2 cores
def test_the_default_configuration_admits_128_w1v_sequences_at_once():
    with LLMEngine(EngineArgs()) as engine:
        info = engine.supervisor.info
        workload = make_workload("W1v", vocab_size=engine.vocab_size)
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
        assert stats.kv_blocks_free >= w1v_blocks(info.block_size, engine.vocab_size) - held
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


def test_tensor_parallel_ranks_agree_on_one_automatic_budget(tiny_model_factory):
    """A budget bound by memory (not by what the sequences can fill): each rank reads the
    memory at its own moment, and they still allocate the same blocks."""
    from tests.test_tensor_parallel import tiny_path

    path = tiny_path(tiny_model_factory, "qwen2-uneven")
    # About 8 MiB a rank, far below what 1024 sequences of 256 tokens could fill.
    utilization = 2 * (8 << 20) / read_memory("cpu").available
    args = EngineArgs(model=str(path), tensor_parallel_size=2, max_model_len=256, max_num_seqs=1024,
                      max_num_batched_tokens=256, gpu_memory_utilization=utilization)
    with LLMEngine(args) as engine:
        infos = engine.supervisor.worker_infos
        assert len(infos) == 2
        assert infos[0].kv_cache_memory_bytes == infos[1].kv_cache_memory_bytes > 0
        assert infos[0].num_blocks == infos[1].num_blocks == engine.statistics().kv_blocks_total
        assert "capped" not in infos[0].kv_cache_sizing  # memory, not the sequences, set it
        engine.add_request("a", {"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=4, ignore_eos=True))
        finished = [o for _ in range(16) for o in engine.step() if o.finished]
        assert len(finished) == 1 and len(finished[0].outputs[0].token_ids) == 4


def test_a_given_budget_past_the_machines_memory_stops_the_start_naming_both(tiny_model_factory):
    total = read_memory("cpu").total
    with pytest.raises(KVCacheTooLargeError, match=r"kv_cache_memory=[0-9.]+ GiB is more than the [0-9.]+ GiB of "
                                                   r"memory this machine has"):
        LLMEngine(EngineArgs(model=str(tiny_model_factory("llama")), kv_cache_memory=2 * total, max_model_len=256))
