"""Contract tests (an in-process runner, a tiny random model): the captured decode path of
``triode.engine.worker.cuda_graphs`` against eager steps, on a CPU through ``EagerReplay`` (a
"replay" runs the captured function again on the static buffers), so the buckets, the
padding rows and their scratch KV block are checked on every machine; the CUDA capture itself
is checked by scripts/gpu_model_check.py."""

from __future__ import annotations

import math

import pytest

from tests.driver import sampled_by_sequence
from triode.engine.config import EngineArgs
from triode.engine.sampling_params import SamplingParams
from triode.engine.worker.cuda_graphs import EagerReplay, batch_buckets
from triode.engine.worker.runner import ModelRunner
from triode.engine.worker_messages import NewSequence, ScheduledChunk, StepPlan


def test_batch_buckets():
    assert batch_buckets(1) == (1,)
    assert batch_buckets(6) == (1, 2, 4, 6)
    assert batch_buckets(20) == (1, 2, 4, 8, 16, 20)
    assert batch_buckets(256)[-3:] == (240, 248, 256)
    assert batch_buckets(300)[-3:] == (248, 256, 300)
    # past vLLM's default of 512, steps run eagerly: a huge max_num_seqs asks for no huge capture
    assert batch_buckets(1024)[-3:] == (248, 256, 512)
    assert batch_buckets(10**9) == batch_buckets(512)


class _Counting(EagerReplay):
    def __init__(self) -> None:
        self.replays = 0

    def __call__(self, run):
        graph, output = super().__call__(run)
        counter = self

        class _Counted:
            @staticmethod
            def replay() -> None:
                counter.replays += 1
                graph.replay()

        return _Counted(), output


@pytest.fixture(scope="module")
def runners(tiny_model_factory):
    path = tiny_model_factory("llama")
    args = EngineArgs(model=str(path), max_num_seqs=8, kv_cache_memory="16MiB", max_model_len=256)
    capture = _Counting()
    return ModelRunner(args, path), ModelRunner(args, path, decode_graph_capture=capture), capture


def _run(runner: ModelRunner, prompts: dict[str, list[int]], schedule: list[list[str]], params: SamplingParams):
    """Prefills every prompt, then runs one decode step per entry of ``schedule`` (the
    sequences decoding in it); returns each sequence's tokens and logprobs."""
    blocks, tables, out = iter(range(runner.num_blocks)), {}, {}
    positions = {}
    chunks = []
    for seq_id, prompt in prompts.items():
        tables[seq_id] = [next(blocks) for _ in range(-(-(len(prompt) + len(schedule) + 1) // runner.block_size))]
        chunks.append(ScheduledChunk(seq_id=seq_id, token_ids=tuple(prompt), start_position=0,
                                     new_block_ids=tuple(tables[seq_id])))
        positions[seq_id] = len(prompt)
    new = tuple(NewSequence(seq_id=s, prompt_token_ids=tuple(p), params=params) for s, p in prompts.items())
    result = runner.execute(StepPlan(step_id=0, new_sequences=new, chunks=tuple(chunks)))
    for seq_id, token in sampled_by_sequence(result).items():
        out[seq_id] = [token]
    for step, decoding in enumerate(schedule, start=1):
        plan = StepPlan(step_id=step, chunks=tuple(
            ScheduledChunk(seq_id=s, token_ids=(out[s][-1][0],), start_position=positions[s]) for s in decoding))
        for seq_id, token in sampled_by_sequence(runner.execute(plan)).items():
            out[seq_id].append(token)
            positions[seq_id] += 1
    runner.execute(StepPlan(step_id=len(schedule) + 1, finished_seq_ids=tuple(prompts)))
    return out


def test_captured_decodes_match_eager_steps(runners):
    eager, captured, capture = runners
    prompts = {f"s{i}": [5 + i, 17, 33 + 2 * i, 9, 41][: 3 + i % 3] for i in range(7)}
    # Batches of 7, 5 (bucket 8, three padding rows), 1, 3 (bucket 4) and 2, changing from
    # step to step so that padding rows land where real rows were before.
    everyone, some = list(prompts), ["s0", "s2", "s4", "s5", "s6"]
    schedule = [everyone, everyone, some, ["s3"], ["s1", "s3", "s6"], some, ["s0", "s6"], everyone]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=3)
    before = capture.replays
    expected = _run(eager, prompts, schedule, params)
    actual = _run(captured, prompts, schedule, params)
    assert capture.replays - before == len(schedule)  # every decode step, not the prefill
    assert {s: [t for t, _ in v] for s, v in actual.items()} == {s: [t for t, _ in v] for s, v in expected.items()}
    for seq_id, entries in expected.items():
        for (_, want), (_, got) in zip(entries, actual[seq_id], strict=True):
            assert math.isclose(want.logprob, got.logprob, abs_tol=1e-5)
            assert [t for t, _ in want.top] == [t for t, _ in got.top]


def test_a_step_beyond_the_largest_bucket_or_with_a_prefill_runs_eagerly(runners):
    _, captured, capture = runners
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    before = capture.replays
    prompts = {f"b{i}": [3, 4, 5 + i] for i in range(9)}  # 9 decodes > 8
    _run(captured, prompts, [list(prompts)], params)
    assert capture.replays == before
    assert captured.num_blocks + 1 == captured.kv_caches[0][0].shape[0]  # the scratch block


def test_enforce_eager_and_cpu_capture_nothing(tiny_model_factory):
    path = tiny_model_factory("llama")
    runner = ModelRunner(EngineArgs(model=str(path), kv_cache_memory="16MiB", max_model_len=256), path)
    assert runner.graphs is None and runner.num_blocks == runner.kv_caches[0][0].shape[0]
