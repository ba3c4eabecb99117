"""unit and script: the benchmark workloads' prompts are token ids of the model's own
vocabulary. Every model with 40,000 tokens or more gets the prompts docs/benchmarks.md's figures
were measured with; a smaller vocabulary (Llama 2's and Mistral's 32,000) gets ids within it,
where `triode bench throughput --model` used to fail on the first prompt ("token id 35126 is
outside the vocabulary [0, 32000)")."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.http_server import BIN
from triode.bench.overhead import write_tiny_model
from triode.bench.workloads import PROMPT_TOKEN_IDS, make_workload, prompt_token_ids
from triode.engine.config import EngineArgs
from triode.engine.model_files.resolve import resolve_model


def ids_of(workload) -> set[int]:
    return {token for prompt in workload.prompts for token in prompt}


@pytest.mark.parametrize("name", ["W1", "W1v"])
def test_every_large_vocabulary_gets_the_same_prompts(name):
    workloads = [make_workload(name, vocab_size=size) for size in (40000, 49152, 151936)]
    assert len(workloads) == 3 and len(workloads[0].prompts) in (64, 128)
    assert workloads[0] == workloads[1] == workloads[2]
    ids = ids_of(workloads[0])
    assert min(ids) >= PROMPT_TOKEN_IDS.start and max(ids) < PROMPT_TOKEN_IDS.stop
    assert max(ids) >= 39000  # the range is drawn from, not cut short


@pytest.mark.parametrize(("vocab_size", "lowest", "stop"), [(32000, 1000, 32000), (384, 96, 384), (2, 0, 2)])
def test_a_smaller_vocabulary_gets_ids_of_its_own(vocab_size, lowest, stop):
    assert prompt_token_ids(vocab_size) == range(lowest, stop)
    workload = make_workload("W1v", vocab_size=vocab_size)
    assert len(workload.prompts) == 128 and len(workload.output_lens) == 128
    ids = ids_of(workload)
    assert min(ids) >= lowest and max(ids) < stop
    # the lengths are the workload's whatever the vocabulary
    assert [len(p) for p in workload.prompts] == [len(p) for p in make_workload("W1v", vocab_size=49152).prompts]


@pytest.mark.parametrize("vocab_size", [0, -5])
def test_a_vocabulary_without_tokens_is_refused(vocab_size):
    with pytest.raises(ValueError, match="vocab_size: expected a positive number of tokens"):
        prompt_token_ids(vocab_size)


@pytest.mark.default_model  # its tokenizer, for the tiny model
@pytest.mark.slow  # an engine start and W1 on a tiny model: 7 s on 2 cores
def test_the_throughput_bench_runs_a_model_of_32000_tokens(tmp_path):
    args = EngineArgs.from_env(model=None)
    tokenizer = resolve_model(args.model, cache_dir=args.resolved_cache_dir()).path
    model = write_tiny_model(tmp_path / "tiny", tokenizer, vocab=32000)
    done = subprocess.run([str(BIN / "triode"), "bench", "throughput", "--model", str(model), "--workloads", "W1",
                           "--skip-hf", "--output-dir", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    written = sorted(path.name for path in (tmp_path / "out").glob("*.json"))
    assert len(written) == 1, written
    result = json.loads((tmp_path / "out" / written[0]).read_text())
    assert result["workloads"]["W1"]["triode"]["tokens_per_second"] > 0
