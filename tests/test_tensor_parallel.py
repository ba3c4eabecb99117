"""Contract tests: tensor parallelism over torch.distributed (gloo on CPU). TP=2 (and TP=4,
slow) gives greedy token ids identical to TP=1 and logprobs within 1e-4, on tiny random
models of every architecture whose KV heads are 1 (replicated), 2, and equal to the
attention heads, plus uneven splits (whole GQA groups, intermediate and vocabulary shards of
different sizes) and row-parallel biases, and GGUF-quantized weights sharded by whole blocks; through the real engine (supervisor, one worker
process per rank) on a tiny model and on the default model; SIGKILL of rank 1 mid-batch
(and a hung rank, slow) restarts the whole group with undisturbed outputs and no stray
process; a follower rank in another process ("another node", slow) joins and rejoins after
a restart; sizes that cannot shard the model, too few CUDA devices, a taken MASTER_PORT and
bad multi-node settings fail at start-up with typed errors naming the constraint, before
any rank is spawned."""

from __future__ import annotations

import itertools
import multiprocessing as mp
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.hf_compare import greedy_params, ours_greedy
from tests.http_server import free_port
from tests.process_tree import descendants
from tests.tp_ranks import Job, run_sharded
from triode import LLM, EngineArgs, SamplingParams, kernels
from triode.engine.errors import KVCacheTooSmallError
from triode.engine.model.config import ModelConfig
from triode.engine.model_files.layout import load_hf_config
from triode.engine.tensor_parallel import (
    RendezvousError,
    TensorParallelSizeError,
    check_tensor_parallel,
    supported_sizes,
)
from triode.engine.worker.checkpoint import (
    blocks_kept_by_shards,
    iter_safetensors,
    quantized_tensors,
)
from triode.engine.worker.distributed import Partition
from triode.engine.worker.models.llama import checkpoint_slices
from triode.kernels.quant_linear import interleaved_kernels_available, quantized_kernels_available

MAX_TOKENS = 16
ATOL = 1e-4

# name -> (architecture, config overrides); heads are 4 unless overridden
TINY = {
    "llama-kv2": ("llama", {}),
    "mistral-kv1": ("mistral", {}),
    "qwen2-kv2": ("qwen2", {}),
    "qwen3-kv2": ("qwen3", {}),
    # KV heads == attention heads, tied embeddings, biases on every projection (o_proj's and
    # down_proj's are row-parallel: added once)
    "llama-mha-bias": ("llama", {"num_key_value_heads": 4, "tie_word_embeddings": True,
                                 "attention_bias": True, "mlp_bias": True}),
    # fused qkv and gate_up tensors in the checkpoint, cut into each rank's q, k, v, gate, up
    "phi3-fused": ("phi3", {}),
    # (1 + w) norms, sandwich norms, soft caps, interleaved windows; q/k norms and local rope
    "gemma2-kv2": ("gemma2", {}),
    "gemma3-kv1": ("gemma3", {}),
    # each expert's 48 / 40 features split 24 + 24 / 20 + 20, the router replicated; Qwen3-MoE's
    # dense second layer split as any MLP
    "mixtral-8x2": ("mixtral", {}),
    "qwen3-moe-8x2": ("qwen3_moe", {}),
    # 3 KV groups over 2 ranks (1 + 2), 99 intermediate (49 + 50), 401 vocab (200 + 201)
    "qwen2-uneven": ("qwen2", {"num_attention_heads": 6, "num_key_value_heads": 3,
                               "hidden_size": 96, "intermediate_size": 99, "vocab_size": 401}),
}


@pytest.fixture(scope="module")
def prompts(tiny_tokenizer):
    texts = ["The quick brown fox", "Paris is the capital of",
             "A paged key-value cache stores attention keys in fixed-size blocks of tokens.",
             "def add(a, b):"]
    return [tuple(tiny_tokenizer.encode(t)) for t in texts]


def tiny_path(factory, name: str) -> Path:
    architecture, overrides = TINY[name]
    return factory(architecture, **overrides)


def runner_args(path: Path) -> EngineArgs:
    # float32 activations, as ours_greedy's reference: a Q4_K shard that loads dequantized runs
    # float32 arithmetic, which integer activations on the other side would part from.
    return EngineArgs(model=str(path), kv_cache_memory=16 << 20, max_model_len=256, quantized_activations="float32")


def _chosen_and_top(token_id: int, entry) -> tuple[float, dict[int, float]]:
    """A position's logprobs from the runner (TokenLogprobs) or the engine (vLLM's dict)."""
    if isinstance(entry, dict):
        return entry[token_id].logprob, {t: lp.logprob for t, lp in entry.items()}
    return entry.logprob, dict(entry.top)


def assert_same_generation(ours, reference, *, label: str = "", atol: float = ATOL) -> None:
    """Token ids identical; each step's chosen and top logprobs within ``atol``."""
    for index, ((tokens, logprobs), (ref_tokens, ref_logprobs)) in enumerate(
        zip(ours, reference, strict=True)
    ):
        assert tokens == ref_tokens, f"{label} prompt {index}: {tokens} != {ref_tokens}"
        for step, (token, got, want) in enumerate(zip(tokens, logprobs, ref_logprobs, strict=True)):
            got_chosen, got_top = _chosen_and_top(token, got)
            want_chosen, want_top = _chosen_and_top(token, want)
            assert abs(got_chosen - want_chosen) < atol, (label, index, step, got, want)
            for top_token, value in got_top.items():
                if top_token in want_top:
                    assert abs(value - want_top[top_token]) < atol, (label, index, step, top_token)


def is_running(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


# --- partitioning (no processes) ---------------------------------------------------------


def _config(heads: int, kv_heads: int, *, intermediate: int = 128, vocab: int = 400) -> ModelConfig:
    return ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=vocab, hidden_size=heads * 16,
        intermediate_size=intermediate, num_layers=1, num_heads=heads, num_kv_heads=kv_heads,
        head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0, rope_scaling=None,
        max_position_embeddings=128, tie_word_embeddings=False, qkv_bias=False, o_bias=False,
        mlp_bias=False, qk_norm=False, sliding_window=None,
    )


def test_default_model_shape_supports_sizes_1_2_3_9():
    # SmolLM2-135M: 9 heads in 3 GQA groups of 3.
    config = _config(9, 3, intermediate=1536, vocab=49152)
    assert supported_sizes(config) == [1, 2, 3, 9]
    rank0, rank1 = (Partition.of(config, rank, 2) for rank in range(2))
    assert (rank0.kv_heads, rank0.q_heads, rank1.kv_heads, rank1.q_heads) == ((0, 1), (0, 3), (1, 3), (3, 9))
    assert rank0.max_kv_heads == rank1.max_kv_heads == 2
    assert (rank0.intermediate, rank1.intermediate) == ((0, 768), (768, 1536))
    assert (rank0.vocab, rank1.vocab) == ((0, 24576), (24576, 49152))
    with pytest.raises(TensorParallelSizeError, match=r"multiple of 3; supported sizes: 1, 2, 3, 9"):
        check_tensor_parallel(config, 4)
    with pytest.raises(TensorParallelSizeError, match=r"divide the 9 attention heads"):
        check_tensor_parallel(config, 6)


@pytest.mark.parametrize("heads,kv_heads", [(4, 1), (4, 2), (4, 4), (9, 3), (6, 3), (8, 8), (32, 8), (12, 2)])
def test_every_rank_owns_whole_gqa_groups(heads, kv_heads):
    config = _config(heads, kv_heads, intermediate=101, vocab=403)
    group = heads // kv_heads
    for size in supported_sizes(config):
        parts = [Partition.of(config, rank, size) for rank in range(size)]
        q_heads = [h for p in parts for h in range(*p.q_heads)]
        assert q_heads == list(range(heads)), size  # each query head on exactly one rank
        for p in parts:
            # every query head of a rank reads a KV head the same rank holds
            assert all(p.kv_heads[0] <= h // group < p.kv_heads[1] for h in range(*p.q_heads))
            assert p.num_kv_heads <= p.max_kv_heads
        kv = {h for p in parts for h in range(*p.kv_heads)}
        assert kv == set(range(kv_heads))  # replicated when size > kv_heads, never lost
        for field, total in (("intermediate", 101), ("vocab", 403)):
            ranges = [getattr(p, field) for p in parts]
            assert ranges[0][0] == 0 and ranges[-1][1] == total
            assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))


def test_each_rank_reads_only_its_slices(tiny_model_factory):
    path = tiny_path(tiny_model_factory, "qwen2-uneven")
    config = ModelConfig.from_hf(load_hf_config(path))
    full = dict(iter_safetensors(path))
    for rank in range(2):
        select = checkpoint_slices(config, Partition.of(config, rank, 2))
        for name, tensor in iter_safetensors(path, select=select):
            spec = select(name)
            expected = full[name] if spec is None else full[name].narrow(spec[0], spec[1], spec[2] - spec[1])
            assert torch.equal(tensor, expected), name
            if spec is not None:
                assert tensor.shape[spec[0]] < full[name].shape[spec[0]], name


def test_one_rank_forms_no_process_group(tiny_model_factory):
    import torch.distributed as dist

    from triode.engine.worker.runner import ModelRunner

    path = tiny_path(tiny_model_factory, "llama-kv2")
    runner = ModelRunner(runner_args(path), path)
    assert runner.parallel is None and not dist.is_initialized()


# --- sharded model math: ranks in spawned processes, no engine ----------------------------


def _jobs(factory, names, prompts):
    return [
        Job(path=tiny_path(factory, name), prompts=tuple(prompts), params=greedy_params(MAX_TOKENS),
            args=runner_args(tiny_path(factory, name)))
        for name in names
    ]


def _check_sharded(factory, names, prompts, world_size):
    sharded = run_sharded(world_size, _jobs(factory, names, prompts))
    for name, ours in zip(names, sharded, strict=True):
        path = tiny_path(factory, name)
        reference = ours_greedy(path, prompts, MAX_TOKENS)
        assert_same_generation(ours, reference, label=f"{name} at TP={world_size}")


def test_tp2_matches_tp1_on_every_architecture(tiny_model_factory, prompts):
    _check_sharded(tiny_model_factory, list(TINY), prompts, 2)


@pytest.fixture(scope="module")
def quantized_ggufs(tmp_path_factory, tiny_tokenizer):
    """kind -> converted cache entry of a tiny Llama GGUF whose matrices are all ``kind``."""
    from tests.gguf_models import tiny_quantizable_llama, write_tiny_gguf
    from triode.engine.model_files.resolve import resolve_model

    directory = tmp_path_factory.mktemp("tp-gguf")
    model = tiny_quantizable_llama(tiny_tokenizer)
    entries = {}
    for kind in ("Q8_0", "Q4_K"):
        write_tiny_gguf(directory / f"tiny.{kind}.gguf", model, tiny_tokenizer, kind)
        entries[kind] = resolve_model(str(directory / f"tiny.{kind}.gguf"), cache_dir=str(directory / "cache"),
                                      progress=False).path
    return entries


@pytest.mark.skipif(not quantized_kernels_available(), reason="no AVX2 or no C compiler")
def test_tp2_shards_quantized_weights_by_whole_blocks(quantized_ggufs, prompts):
    """Q8_0 (32-weight blocks) shards every matrix quantized; Q4_K (256) splits o_proj's 256
    columns into blocks of 128 that do not exist, so that one matrix loads dequantized."""
    config = ModelConfig.from_hf(load_hf_config(quantized_ggufs["Q8_0"]))
    for rank in range(2):
        select = checkpoint_slices(config, Partition.of(config, rank, 2))
        for kind, entry in quantized_ggufs.items():
            kinds = quantized_tensors(entry)
            kept = blocks_kept_by_shards(kinds, select)
            split = {"Q8_0": set(), "Q4_K": {f"model.layers.{i}.self_attn.o_proj.weight" for i in range(2)}}
            assert set(kinds) - set(kept) == split[kind]
    jobs = [Job(path=entry, prompts=tuple(prompts), params=greedy_params(MAX_TOKENS), args=runner_args(entry))
            for entry in quantized_ggufs.values()]
    for (kind, entry), ours in zip(quantized_ggufs.items(), run_sharded(2, jobs), strict=True):
        assert_same_generation(ours, ours_greedy(entry, prompts, MAX_TOKENS), label=f"{kind} at TP=2")


@pytest.mark.slow
def test_tp4_replicates_kv_heads(tiny_model_factory, prompts):
    # 2 KV heads on 4 ranks (each twice), 1 KV head on 4 ranks, and 4 of 4 heads.
    _check_sharded(tiny_model_factory, ["llama-kv2", "mistral-kv1", "llama-mha-bias"], prompts, 4)


# --- through the engine: supervisor, one worker process per rank --------------------------


def _engine_outputs(llm: LLM, prompts, params):
    outputs = llm.generate([list(p) for p in prompts], params, use_tqdm=False)
    return [o.outputs[0] for o in outputs], outputs


def test_engine_tp2_matches_tp1_with_prompt_logprobs(tiny_model_factory, prompts):
    path = tiny_path(tiny_model_factory, "qwen2-uneven")
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5,
                            prompt_logprobs=3)
    results = {}
    # With async scheduling every rank gets the plan made ahead with its sampled tokens filled in.
    for size, ahead in ((1, False), (2, False), (2, True)):
        before = descendants()
        with LLM(str(path), tensor_parallel_size=size, kv_cache_memory="16MiB", max_model_len=256,
                 async_scheduling=ahead) as llm:
            completions, outputs = _engine_outputs(llm, prompts, params)
            stats = llm.llm_engine.statistics()
            pids = stats.worker_pids
        assert not (set(pids) & descendants()), "a rank outlived the engine"
        assert descendants() <= before
        results[size, ahead] = (
            [(list(c.token_ids), list(c.logprobs)) for c in completions],
            [(o.prompt_token_ids, o.prompt_logprobs) for o in outputs],
        )
        assert stats.tensor_parallel_size == size and len(pids) == size
        assert len(stats.rank_step_seconds_total) == size == len(stats.rank_peak_rss_bytes)
        assert all(seconds > 0 for seconds in stats.rank_step_seconds_total)
        if size == 2:
            assert all(0 < c < s for c, s in zip(stats.rank_collective_seconds_total,
                                                  stats.rank_step_seconds_total, strict=True))
    assert_same_generation(results[2, False][0], results[1, False][0], label="engine")
    assert_same_generation(results[2, True][0], results[1, False][0], label="engine, async scheduling")
    for (prompt, got), (_, want) in zip(results[2, False][1], results[1, False][1], strict=True):
        assert got[0] is None and want[0] is None and len(got) == len(want) == len(prompt)
        for token, a, b in zip(prompt[1:], got[1:], want[1:], strict=True):
            assert abs(a[token].logprob - b[token].logprob) < ATOL


@pytest.mark.slow
def test_hung_rank_trips_the_watchdog_and_the_group_restarts(tiny_model_factory, prompts):
    path = tiny_path(tiny_model_factory, "llama-kv2")
    reference = [tokens for tokens, _ in ours_greedy(path, prompts, MAX_TOKENS)]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with LLM(str(path), tensor_parallel_size=2, kv_cache_memory="16MiB", max_model_len=256,
             step_timeout=2.0) as llm:
        engine = llm.llm_engine
        for index, prompt in enumerate(prompts):
            engine.add_request(f"hang-{index}", list(prompt), params)
        old_pids = engine.statistics().worker_pids
        finished, steps = {}, 0
        while engine.has_unfinished_requests():
            if steps == 3:
                os.kill(old_pids[1], signal.SIGSTOP)  # rank 0 now waits in its next all-reduce
            for output in engine.step():
                if output.finished:
                    finished[output.request_id] = list(output.outputs[0].token_ids)
            steps += 1
        stats = engine.supervisor.statistics()
    assert [finished[f"hang-{i}"] for i in range(len(prompts))] == reference
    assert stats.worker_restarts == 1 and "step_timeout" in stats.last_failure
    assert not any(is_running(pid) for pid in old_pids)


@pytest.mark.slow
def test_follower_rank_runs_on_another_node_and_rejoins_after_a_restart(
    tiny_model_factory, prompts, monkeypatch
):
    # Two "nodes" on loopback: the engine runs rank 0, a follower process runs rank 1.
    path = tiny_path(tiny_model_factory, "llama-kv2")
    reference = [tokens for tokens, _ in ours_greedy(path, prompts, MAX_TOKENS)]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    port = free_port()
    for name, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(port))):
        monkeypatch.setenv(name, value)
    follower = subprocess.Popen(
        [sys.executable, "-m", "triode.engine.worker.follower", "--rank", "1", "--threads", "1"],
        env=dict(os.environ),
    )
    try:
        monkeypatch.setenv("TRIODE_TP_LOCAL_RANKS", "1")
        with LLM(str(path), tensor_parallel_size=2, kv_cache_memory="16MiB", max_model_len=256) as llm:
            engine = llm.llm_engine
            assert len(engine.statistics().worker_pids) == 1  # only rank 0 is the engine's
            outputs = llm.generate([list(p) for p in prompts], params, use_tqdm=False)
            assert [list(o.outputs[0].token_ids) for o in outputs] == reference
            # Rank 0 dies mid-batch: the engine restarts it, the follower joins the new group.
            for index, prompt in enumerate(prompts):
                engine.add_request(f"node-{index}", list(prompt), params)
            finished, steps = {}, 0
            while engine.has_unfinished_requests():
                if steps == 3:
                    os.kill(engine.statistics().worker_pids[0], signal.SIGKILL)
                for output in engine.step():
                    if output.finished:
                        finished[output.request_id] = list(output.outputs[0].token_ids)
                steps += 1
            assert [finished[f"node-{i}"] for i in range(len(prompts))] == reference
            assert engine.statistics().worker_restarts == 1
        assert follower.poll() is None  # it outlives the engine, waiting for the next group
    finally:
        follower.kill()
        follower.wait()


@pytest.fixture(scope="module")
def default_path():
    from triode.engine.model_files.resolve import resolve_model

    return resolve_model(None, cache_dir=EngineArgs().resolved_cache_dir()).path


@pytest.fixture(scope="module")
def default_prompts(default_path):
    from triode.engine.inputs import load_tokenizer

    tokenizer = load_tokenizer(default_path)
    texts = ["What is the capital of France?", "def quicksort(items):",
             "The three laws of thermodynamics are", "List five fruits:",
             "Once upon a time, in a small village by the sea, there lived an old fisherman who",
             "1, 2, 3, 4,"]
    return [tuple(tokenizer.encode(text)) for text in texts]


@pytest.fixture(scope="module")
def default_reference(default_path, default_prompts):
    # The engine's default activations (int16 on CPUs with AVX2, float32 elsewhere),
    # as default_tp2 runs: TP=2 against TP=1 of the same arithmetic.
    return ours_greedy(default_path, default_prompts, MAX_TOKENS, quantized_activations="auto")


@pytest.fixture(scope="module")
def default_tp2():
    with LLM(tensor_parallel_size=2, kv_cache_memory="128MiB", max_model_len=512) as llm:
        yield llm


@pytest.mark.default_model
def test_default_model_tp2_matches_tp1(default_tp2, default_prompts, default_reference):
    completions, _ = _engine_outputs(default_tp2, default_prompts, greedy_params(MAX_TOKENS))
    ours = [(list(c.token_ids), list(c.logprobs)) for c in completions]
    # Integer activations round each layer's input: a sum in another order (a row-parallel
    # matrix's two halves) may round an activation the other way, a step of 1 / 32638 of its
    # group's largest, where float32 ones move by their last bit (measured in int16: 1.9e-4 on
    # chosen tokens, 2.3e-3 on an alternative at -12.5 with AVX-512; 5.5e-3 on an alternative
    # at -4.1 with the AVX2 build, whose attention sums in another order).
    atol = 1e-2 if interleaved_kernels_available() else ATOL  # auto: int16 where they run
    assert_same_generation(ours, default_reference, label="default model", atol=atol)


@pytest.mark.default_model
def test_sigkill_of_rank_1_restarts_the_group_and_loses_nothing(default_tp2, default_prompts, default_reference):
    engine = default_tp2.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for index, prompt in enumerate(default_prompts):
        engine.add_request(f"kill-{index}", list(prompt), params)
    old_pids = engine.statistics().worker_pids
    finished, steps = {}, 0
    while engine.has_unfinished_requests():
        if steps == 4:
            os.kill(old_pids[1], signal.SIGKILL)
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = list(output.outputs[0].token_ids)
        steps += 1
    assert [finished[f"kill-{i}"] for i in range(len(default_prompts))] == [t for t, _ in default_reference]
    stats = engine.statistics()
    assert stats.worker_restarts == 1
    assert len(stats.worker_pids) == 2 and not set(stats.worker_pids) & set(old_pids)
    assert not any(is_running(pid) for pid in old_pids), "a rank of the old group survived"
    assert stats.kv_blocks_free == stats.kv_blocks_total


# --- bad input: typed errors at start-up, nothing left running ----------------------------


@pytest.mark.parametrize(
    "options,error,message",
    [
        ({"tensor_parallel_size": 3}, TensorParallelSizeError,
         r"tensor_parallel_size=3 cannot shard .* 4 attention heads and 2 KV heads: .*multiple of 2; "
         r"supported sizes: 1, 2, 4"),
        ({"tensor_parallel_size": 8}, TensorParallelSizeError,
         r"must divide the 4 attention heads; supported sizes: 1, 2, 4"),
        ({"tensor_parallel_size": 2, "device": "cuda"}, TensorParallelSizeError,
         r"needs one CUDA device per rank"),
    ],
    ids=["not-dividing", "more-than-heads", "more-than-cuda-devices"],
)
def test_bad_sizes_fail_before_spawning(tiny_model_factory, options, error, message):
    if options.get("device") == "cuda" and torch.cuda.device_count() >= 2:
        pytest.skip("this machine has the CUDA devices")
    path = tiny_path(tiny_model_factory, "llama-kv2")
    before = descendants()
    with pytest.raises(error, match=message) as info:
        LLM(str(path), kv_cache_memory="16MiB", max_model_len=256, **options)
    assert info.value.field == "tensor_parallel_size"
    assert descendants() <= before


def test_taken_or_bad_rendezvous_settings_fail_before_spawning(tiny_model_factory, monkeypatch):
    path = tiny_path(tiny_model_factory, "llama-kv2")
    before = descendants()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        monkeypatch.setenv("MASTER_PORT", str(taken.getsockname()[1]))
        with pytest.raises(RendezvousError, match=r"MASTER_PORT=\d+ is not free"):
            LLM(str(path), tensor_parallel_size=2, kv_cache_memory="16MiB", max_model_len=256)
    monkeypatch.setenv("MASTER_PORT", "http")
    with pytest.raises(RendezvousError, match=r"MASTER_PORT='http' is not a TCP port"):
        LLM(str(path), tensor_parallel_size=2, kv_cache_memory="16MiB", max_model_len=256)
    monkeypatch.delenv("MASTER_PORT")
    monkeypatch.setenv("TRIODE_TP_LOCAL_RANKS", "1")  # followers elsewhere, but where is rank 0?
    with pytest.raises(RendezvousError, match=r"TRIODE_TP_LOCAL_RANKS=1 .* MASTER_ADDR:MASTER_PORT"):
        LLM(str(path), tensor_parallel_size=2, kv_cache_memory="16MiB", max_model_len=256)
    monkeypatch.setenv("TRIODE_TP_LOCAL_RANKS", "3")
    with pytest.raises(RendezvousError, match=r"from 1 to tensor_parallel_size=2"):
        LLM(str(path), tensor_parallel_size=2, kv_cache_memory="16MiB", max_model_len=256)
    assert descendants() <= before


def test_rank_load_error_fails_the_start_and_leaves_no_rank(tiny_model_factory):
    path = tiny_path(tiny_model_factory, "llama-kv2")
    before = descendants()
    with pytest.raises(KVCacheTooSmallError, match="kv_cache_memory"):
        LLM(str(path), tensor_parallel_size=2, kv_cache_memory=4096, max_model_len=256)
    assert descendants() <= before


def _sum_rank(rank: int, port: int, results) -> None:
    """One of three ranks: the all-reduce of a row alone and inside a batch of 300."""
    import types

    import torch.distributed as dist

    from triode.engine.worker.distributed import TensorParallelGroup

    torch.set_num_threads(1)
    kernels.set_batch_invariant(True)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=3)
        group = types.SimpleNamespace(size=3, collective_seconds=0.0)  # what all_reduce reads
        generator = torch.Generator().manual_seed(rank)
        row, batch = torch.randn(1, 4096, generator=generator), torch.randn(300, 4096, generator=generator)
        batch[123] = row[0]
        alone = TensorParallelGroup.all_reduce(group, row.clone())[0]
        in_batch = TensorParallelGroup.all_reduce(group, batch)[123]
        # numpy arrays travel by value (a tensor's shared memory would go with the process)
        results.put((rank, alone.numpy(), in_batch.numpy(), row[0].numpy()))
        dist.destroy_process_group()
    except BaseException as error:
        results.put((rank, None, None, repr(error)))


def test_three_ranks_sum_a_row_in_rank_order_when_invariant():
    """--batch-invariant with three ranks: each element summed rank 0, 1, 2 whatever the
    message's size (gloo's ring chunks a message by its size)."""
    context = mp.get_context("spawn")
    results, port = context.Queue(), free_port()
    ranks = [context.Process(target=_sum_rank, args=(rank, port, results)) for rank in range(3)]
    for process in ranks:
        process.start()
    outcomes = sorted((results.get(timeout=120) for _ in ranks), key=lambda outcome: outcome[0])
    for process in ranks:
        process.join(timeout=30)
    assert len(outcomes) == 3
    assert all(alone is not None for _, alone, _, _ in outcomes), outcomes
    parts = [torch.from_numpy(outcome[3]) for outcome in outcomes]
    in_rank_order = parts[0] + parts[1] + parts[2]
    for rank, alone, in_batch, _ in outcomes:
        assert torch.equal(torch.from_numpy(alone), in_rank_order), f"rank {rank} alone"
        assert torch.equal(torch.from_numpy(in_batch), in_rank_order), f"rank {rank} in a batch"
