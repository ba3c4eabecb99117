"""Unit tests of the KV cache's automatic budget (worker/kv_budget.py): the sizing rule, the
memory readings it starts from, the check of a given budget against them, the sizes a budget is
written in, the blocks a budget holds, and a zeroed cache that costs only what is written."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from triode.engine.config import EngineArgs, parse_size
from triode.engine.errors import InvalidRequestError, KVCacheTooLargeError, KVCacheTooSmallError
from triode.engine.model.config import ModelConfig
from triode.engine.worker import kv_budget
from triode.engine.worker.kv_budget import (
    MemoryReading,
    activation_bytes,
    automatic_kv_cache_bytes,
    blocks_for_budget,
    check_given_budget,
)

GiB = 2**30
UNBOUNDED = 1 << 62


def test_a_cpu_takes_its_share_of_the_memory_available_less_the_activations():
    reading = MemoryReading(total=24 * GiB, available=20 * GiB, on_gpu=False)
    assert automatic_kv_cache_bytes(reading, utilization=0.5, ranks_sharing=1, activation_bytes=0,
                                    most_useful_bytes=UNBOUNDED) == 10 * GiB
    # Ranks of one host split it; the activations come off each rank's part.
    assert automatic_kv_cache_bytes(reading, utilization=0.5, ranks_sharing=2, activation_bytes=GiB,
                                    most_useful_bytes=UNBOUNDED) == 4 * GiB


def test_a_gpu_takes_its_share_of_the_device_less_what_is_in_use():
    # 80 GiB device, 16 GiB in use after the weights: 0.9 x 80 - 16 - 2 of activations = 54.
    reading = MemoryReading(total=80 * GiB, available=64 * GiB, on_gpu=True)
    assert automatic_kv_cache_bytes(reading, utilization=0.9, ranks_sharing=4, activation_bytes=2 * GiB,
                                    most_useful_bytes=UNBOUNDED) == 54 * GiB


def test_the_budget_stops_at_what_the_sequences_can_fill_and_never_goes_negative():
    reading = MemoryReading(total=24 * GiB, available=20 * GiB, on_gpu=False)
    assert automatic_kv_cache_bytes(reading, utilization=0.5, ranks_sharing=1, activation_bytes=0,
                                    most_useful_bytes=3 * GiB) == 3 * GiB
    full = MemoryReading(total=80 * GiB, available=GiB, on_gpu=True)
    assert automatic_kv_cache_bytes(full, utilization=0.5, ranks_sharing=1, activation_bytes=0,
                                    most_useful_bytes=UNBOUNDED) == 0


def test_activations_count_the_widest_layer_and_the_logits():
    assert activation_bytes(max_num_batched_tokens=2, hidden_size=10, intermediate_size=20, vocab_size=100,
                            element_size=2) == 2 * (40 * 2 + 100 * 4)
    assert activation_bytes(max_num_batched_tokens=1, hidden_size=100, intermediate_size=20, vocab_size=0,
                            element_size=4) == 300 * 4


def test_a_cgroup_limit_bounds_the_reading(tmp_path, monkeypatch):
    (tmp_path / "memory.max").write_text("8589934592\n")  # 8 GiB
    (tmp_path / "memory.current").write_text(str(6 * GiB))
    assert kv_budget._cgroup_room(tmp_path) == (8 * GiB, 2 * GiB)
    (tmp_path / "memory.max").write_text("max\n")
    assert kv_budget._cgroup_room(tmp_path) is None
    monkeypatch.setattr(kv_budget, "_cgroup_room", lambda: (8 * GiB, 2 * GiB))
    reading = kv_budget.read_memory("cpu")
    assert reading.total == 8 * GiB and reading.available <= 2 * GiB and not reading.on_gpu


def test_meminfo_is_read_in_bytes(tmp_path):
    (tmp_path / "meminfo").write_text("MemTotal:       24000000 kB\nMemFree: 100 kB\nMemAvailable:   20000000 kB\n"
                                      "HugePages_Total:       0\n")
    values = kv_budget._meminfo(tmp_path / "meminfo")
    assert (values["MemTotal"], values["MemAvailable"]) == (24000000 * 1024, 20000000 * 1024)


def test_the_setting_is_a_fraction_and_an_explicit_budget_is_kept():
    assert EngineArgs().kv_cache_memory is None
    assert EngineArgs(kv_cache_memory="2GiB").kv_cache_memory == 2 * GiB
    assert EngineArgs.from_env({"TRIODE_GPU_MEMORY_UTILIZATION": "0.7"}).gpu_memory_utilization == 0.7
    for wrong in (0.0, 1.5, -0.1):
        with pytest.raises(InvalidRequestError, match="gpu_memory_utilization must be in") as error:
            EngineArgs(gpu_memory_utilization=wrong)
        assert error.value.field == "gpu_memory_utilization"


def test_sizes_reach_terabytes_and_a_number_past_any_float_is_not_a_size():
    assert parse_size("1.5TB") == 1_500_000_000_000 and parse_size("2TiB") == 2 << 40
    for wrong in ("1e400GiB", "inf", "nan", "12 parsecs"):
        with pytest.raises(ValueError, match="is not a size"):
            parse_size(wrong)
        # the variable's error gives the reason too (it said "not a valid int | None")
        with pytest.raises(InvalidRequestError, match=f"TRIODE_KV_CACHE_MEMORY: '{wrong}' is not a size") as error:
            EngineArgs.from_env({"TRIODE_KV_CACHE_MEMORY": wrong})
        assert error.value.field == "kv_cache_memory"
    assert EngineArgs.from_env({"TRIODE_KV_CACHE_MEMORY": "2TiB"}).kv_cache_memory == 2 << 40


def test_a_given_budget_past_the_memory_there_is_stops_the_start_and_past_what_is_free_warns():
    """Found by probing: kv_cache_memory=100GiB on a 23 GiB machine failed the load with a bare
    ENOMEM ("the workers could not load the model"), and 1e30 with an OverflowError; 30GiB
    started, to run the machine out of memory once the cache filled."""
    cpu = MemoryReading(total=24 * GiB, available=20 * GiB, on_gpu=False)
    assert check_given_budget(20 * GiB, cpu, ranks_sharing=1) is None
    assert check_given_budget(10 * GiB, cpu, ranks_sharing=2) is None
    warning = check_given_budget(22 * GiB, cpu, ranks_sharing=1)
    assert warning is not None and "kv_cache_memory=22.00 GiB is more than the 20.00 GiB of memory available" in warning
    assert "x 2 ranks" in (check_given_budget(11 * GiB, cpu, ranks_sharing=2) or "")
    for budget, ranks in ((100 * GiB, 1), (13 * GiB, 2), (10**30, 1)):
        with pytest.raises(KVCacheTooLargeError, match=r"is more than the 24\.00 GiB of memory this machine has "
                                                       r"\(lower it, or leave it unset"):
            check_given_budget(budget, cpu, ranks_sharing=ranks)
    gpu = MemoryReading(total=80 * GiB, available=70 * GiB, on_gpu=True)
    with pytest.raises(KVCacheTooLargeError, match="memory the device has"):
        check_given_budget(81 * GiB, gpu, ranks_sharing=1)
    assert "run the device out of memory" in (check_given_budget(75 * GiB, gpu, ranks_sharing=1) or "")


def test_a_budget_becomes_blocks_and_must_hold_one_sequence_of_max_model_len():
    config = ModelConfig.from_hf({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 384,
                                  "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                                  "num_attention_heads": 4, "num_key_value_heads": 2,
                                  "max_position_embeddings": 1024}, source="config.json")
    args = EngineArgs(block_size=16)
    block = 16 * 2 * 2 * 2 * 16 * 4  # tokens x (K, V) x layers x KV heads x head dim x float32 bytes
    options = dict(config=config, dtype=torch.float32, kv_heads=2, max_model_len=1024)
    assert blocks_for_budget(128 * block + block - 1, args, reserved_blocks=1, **options) == (127, 0)
    reading = MemoryReading(total=24 * GiB, available=20 * GiB, on_gpu=False)
    with pytest.raises(KVCacheTooSmallError, match=r"holds 1008 tokens, fewer than the 1024 one sequence of "
                       r"max_model_len=1024 .*sized from the 20\.00 GiB of memory available"):
        blocks_for_budget(64 * block, args, reserved_blocks=1, reading=reading, **options)
    with pytest.raises(KVCacheTooSmallError, match=r"lower max_model_len\)$"):  # a given budget: no reading
        blocks_for_budget(64 * block, args, reserved_blocks=1, **options)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/status")
def test_a_large_zeroed_cache_costs_only_the_pages_written():
    probe = textwrap.dedent("""
        import torch
        from triode.engine.worker.host_memory import zeroed_tensor

        def resident_mib():
            with open("/proc/self/status") as status:
                return next(int(line.split()[1]) for line in status if line.startswith("VmRSS")) // 1024

        before = resident_mib()
        cache = zeroed_tensor((4096, 16, 8, 64), torch.float32, torch.device("cpu"))  # 128 MiB
        assert cache.shape == (4096, 16, 8, 64) and not cache[::97].any()
        cache[5].fill_(1.0)
        assert cache.sum() == 16 * 8 * 64
        print(resident_mib() - before)
    """)
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert int(done.stdout) < 48, done.stdout  # of 128 MiB: the pages read and written only


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/smaps")
def test_a_zeroed_cache_is_written_into_small_pages():
    # A first write faulting in huge pages cost 3-6x more, inside a step (host_memory.py).
    probe = textwrap.dedent("""
        import torch
        from triode.engine.worker.host_memory import zeroed_tensor

        cache = zeroed_tensor((512, 16, 8, 64), torch.float32, torch.device("cpu"))  # 16 MiB
        cache.fill_(1.0)
        address = cache.data_ptr()
        with open("/proc/self/smaps") as smaps:
            inside = False
            for line in smaps:
                fields = line.split()
                if "-" in fields[0] and not fields[0].endswith(":"):
                    start, end = (int(part, 16) for part in fields[0].split("-"))
                    inside = start <= address < end
                elif inside and fields[0] == "AnonHugePages:":
                    print(fields[1])
    """)
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["0"], done.stdout
