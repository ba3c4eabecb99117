"""Contract tests: speculative decoding through the real engine (worker process). With prompt
lookup configured, greedy outputs and their logprobs are the plain engine's, token for token
and bit for bit: on the default model for extractive prompts and free ones, together, on a KV
cache so small that sequences are preempted and recomputed, with the worker SIGKILLed
mid-stream, under a JSON schema, with stop strings and with async scheduling; on tiny float
models of every family (with --batch-invariant, as their kernels need), with LoRA adapters,
over two tensor-parallel ranks, and with draft models (the model itself, and another of its
tokenizer). A draft of another vocabulary or tokenizer,
or one whose cache share is too small, is refused naming the field. At temperature 1 with
seeds, the tokens sampled with and without speculation have the same distribution (a
two-sample chi-squared test with a stated false-alarm rate)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jsonschema
import pytest
import torch

from tests.lora_adapters import build_adapter
from tests.test_batch_invariance_contract import generate_killing_the_worker
from tests.test_structured_contract import BLOCK_BYTES, PERSON
from triode import LLM, LoRARequest, SamplingParams, StructuredOutputsParams
from triode.engine.config import EngineArgs
from triode.engine.errors import InvalidRequestError, KVCacheTooSmallError
from triode.engine.worker.draft_model import DraftModelProposer

pytestmark = [pytest.mark.contract]

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
SOURCE = ("The committee met on Tuesday to review the budget for the new library. After a long "
          "discussion, members agreed to fund the reading room, the children's section and the archive, "
          "but postponed the decision on the cafe until the spring.")
PROMPTS = [
    f"Repeat the following text exactly.\n\nText: {SOURCE}\n\nRepeated text:",
    f"Rewrite the text, replacing 'library' with 'museum'.\n\nText: {SOURCE}\n\nRewritten text:",
    "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n",
    "Write a short poem about the sea.",
    "List the numbers from 1 to 30, separated by commas: 1, 2, 3,",
]


def greedy(**options) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, logprobs=3, **options)


def traces(outputs) -> list[list[tuple[int, dict[int, float]]]]:
    assert all(len(o.outputs) == 1 for o in outputs)
    return [[(token, {t: lp.logprob for t, lp in top.items()})
             for token, top in zip(o.outputs[0].token_ids, o.outputs[0].logprobs, strict=True)] for o in outputs]


@pytest.mark.default_model
def test_greedy_outputs_with_prompt_lookup_are_the_plain_outputs():
    options = {"kv_cache_memory": "128MiB", "max_model_len": 512, "batch_invariant": True}
    with LLM(**options) as plain:
        expected = traces(plain.generate(PROMPTS, greedy(), use_tqdm=False))
        alone = [traces(plain.generate(prompt, greedy(), use_tqdm=False))[0] for prompt in PROMPTS[:2]]
    assert len(expected) == len(PROMPTS)
    assert expected[:2] == alone
    # disable_by_batch_size 8: all five prompts speculate together
    config = {**NGRAM, "disable_by_batch_size": 8}
    with LLM(speculative_config=config, **options) as llm:
        for prompt, trace in zip(PROMPTS[:2], alone, strict=True):
            assert traces(llm.generate(prompt, greedy(), use_tqdm=False)) == [trace]
        assert traces(llm.generate(PROMPTS, greedy(), use_tqdm=False)) == expected
        killed = traces(generate_killing_the_worker(llm, 8, PROMPTS, greedy()))
        stats = llm.llm_engine.statistics().spec_decode
    assert killed == expected
    assert stats is not None and stats.num_drafts > 20
    assert stats.num_accepted_tokens > stats.num_draft_tokens / 2
    # 12 blocks of 16 tokens cannot hold the prompts (~30-70 tokens) and their outputs at once
    with LLM(speculative_config=config, kv_cache_memory=12 * BLOCK_BYTES, max_model_len=128,
             max_num_batched_tokens=32, long_prefill_token_threshold=16, batch_invariant=True) as small:
        preempted = small.generate(PROMPTS, greedy(), use_tqdm=False)
        assert small.llm_engine.statistics().num_preemptions > 0
    assert traces(preempted) == expected


@pytest.mark.default_model
def test_schemas_stop_strings_and_async_scheduling_keep_the_plain_outputs():
    constrained = SamplingParams(temperature=0.0, max_tokens=80,
                                 structured_outputs=StructuredOutputsParams(json=PERSON))
    person = "Describe a person as JSON with name, age, city and tags. The person: Anna, 31, from Oslo."
    stopped = SamplingParams(temperature=0.0, max_tokens=60, stop=["reading room", "cafe"])
    prompts, params = [person, PROMPTS[0], PROMPTS[1]], [constrained, stopped, stopped]
    with LLM(kv_cache_memory="128MiB", max_model_len=512) as plain:
        expected = plain.generate(prompts, params, use_tqdm=False)
    for options in ({}, {"async_scheduling": True}):
        with LLM(speculative_config=NGRAM, kv_cache_memory="128MiB", max_model_len=512, **options) as llm:
            outputs = llm.generate(prompts, params, use_tqdm=False)
            assert llm.llm_engine.statistics().spec_decode.num_accepted_tokens > 0
        assert len(outputs) == len(prompts)
        for got, want in zip(outputs, expected, strict=True):
            assert (got.outputs[0].text, got.outputs[0].token_ids) == (want.outputs[0].text, want.outputs[0].token_ids)
            assert got.outputs[0].finish_reason == want.outputs[0].finish_reason
    jsonschema.validate(json.loads(expected[0].outputs[0].text), PERSON)
    assert [o.outputs[0].stop_reason for o in expected[1:]] == ["reading room", "reading room"]


TINY_PROMPTS = ["the cat sat on the mat and the cat", "one two three one two three one", "a b c d a b c d a b"]


def decode_alike(model: Path, config: dict, expected: list | None = None):
    """The tiny prompts' greedy traces with ``config`` and (unless given) without; returns
    (traces, speculative decoding's counters)."""
    options = {"model": str(model), "kv_cache_memory": "32MiB", "max_model_len": 256, "batch_invariant": True}
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=2)
    if expected is None:
        with LLM(**options) as plain:
            expected = traces(plain.generate(TINY_PROMPTS, params, use_tqdm=False))
    with LLM(speculative_config=config, **options) as llm:
        got = traces(llm.generate(TINY_PROMPTS, params, use_tqdm=False))
        stats = llm.llm_engine.statistics().spec_decode
    assert len(got) == len(TINY_PROMPTS)
    assert got == expected
    assert stats is not None
    return expected, stats


@pytest.mark.slow
def test_tiny_models_of_each_family_decode_the_same_with_prompt_lookup(tiny_model):
    # a random model's greedy text soon repeats itself: prompt lookup then proposes runs of it
    _, stats = decode_alike(tiny_model, {**NGRAM, "prompt_lookup_min": 1})
    assert stats.num_accepted_tokens > 0


def test_a_tiny_llama_decodes_the_same_with_prompt_lookup_and_with_draft_models(tiny_model_factory):
    target = tiny_model_factory("llama")
    expected, stats = decode_alike(target, {**NGRAM, "prompt_lookup_min": 1})
    assert stats.num_accepted_tokens > 0
    # the model as its own draft agrees with itself; a one-layer model of the same tokenizer mostly not
    _, stats = decode_alike(target, {"model": str(target), "num_speculative_tokens": 3}, expected)
    assert stats.num_drafts > 0 and stats.num_accepted_tokens == stats.num_draft_tokens
    draft = tiny_model_factory("llama", num_hidden_layers=1, seed=1)
    _, stats = decode_alike(target, {"model": str(draft), "num_speculative_tokens": 3}, expected)
    assert stats.num_drafts > 0 and stats.num_accepted_tokens < stats.num_draft_tokens


def test_lora_adapters_decode_the_same_with_prompt_lookup(tiny_model_factory, tmp_path):
    """A verifying sequence's rows carry its adapter, among base rows and another adapter's."""
    target = tiny_model_factory("llama")
    adapters = [LoRARequest(f"a{i}", i + 1, str(build_adapter(target, tmp_path / f"a{i}", rank=4, seed=i, scale=3.0)))
                for i in range(2)]
    loras = [adapters[0], None, adapters[1]]
    options = {"model": str(target), "kv_cache_memory": "32MiB", "max_model_len": 256, "batch_invariant": True,
               "enable_lora": True, "max_loras": 2}
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=2)
    with LLM(**options) as plain:
        expected = traces(plain.generate(TINY_PROMPTS, params, use_tqdm=False, lora_request=loras))
    with LLM(speculative_config={**NGRAM, "prompt_lookup_min": 1}, **options) as llm:
        got = traces(llm.generate(TINY_PROMPTS, params, use_tqdm=False, lora_request=loras))
        stats = llm.llm_engine.statistics().spec_decode
    assert len(got) == len(expected) == 3
    assert got == expected
    assert stats is not None and stats.num_accepted_tokens > 0


@pytest.mark.slow  # two ranks of two engines: a quarter of a minute
def test_tensor_parallel_ranks_verify_alike(tiny_model_factory):
    """Two ranks run every verifying chunk's rows; rank 0 verifies and proposes. With async
    scheduling the ranks also agree on the steps planned ahead between speculating ones."""
    target = tiny_model_factory("llama")
    options = {"model": str(target), "kv_cache_memory": "32MiB", "max_model_len": 256, "batch_invariant": True,
               "tensor_parallel_size": 2}
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=2)
    with LLM(**options) as plain:
        expected = traces(plain.generate(TINY_PROMPTS, params, use_tqdm=False))
    for ahead in (False, True):
        with LLM(speculative_config={**NGRAM, "prompt_lookup_min": 1}, async_scheduling=ahead, **options) as llm:
            got = traces(llm.generate(TINY_PROMPTS, params, use_tqdm=False))
            stats = llm.llm_engine.statistics().spec_decode
        assert got == expected, f"async scheduling {ahead}"
        assert stats is not None and stats.num_accepted_tokens > 0


def test_a_draft_model_of_another_vocabulary_is_refused_naming_the_field(tiny_model_factory, tmp_path):
    target = tiny_model_factory("llama")
    wider = tiny_model_factory("llama", vocab_size=512)
    with pytest.raises(InvalidRequestError, match="vocab_size") as caught:
        LLM(model=str(target), speculative_config={"model": str(wider), "num_speculative_tokens": 2})
    assert caught.value.field == "speculative_config"
    # the same shapes, two tokens' ids swapped in the tokenizer
    swapped = tmp_path / "swapped"
    shutil.copytree(target, swapped)
    tokenizer = json.loads((swapped / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    first, second = sorted(vocab, key=vocab.get)[100:102]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    (swapped / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(InvalidRequestError, match="tokenizer differs") as caught:
        LLM(model=str(target), speculative_config={"model": str(swapped), "num_speculative_tokens": 2})
    assert caught.value.field == "speculative_config"


def test_a_draft_model_whose_cache_share_is_too_small_is_refused(tiny_model_factory):
    target = tiny_model_factory("llama")
    args = EngineArgs(model=str(target), max_model_len=256,
                      speculative_config={"model": str(target), "num_speculative_tokens": 2})
    with pytest.raises(KVCacheTooSmallError, match="speculative_config"):
        DraftModelProposer(args, device=torch.device("cpu"), dtype=torch.float32, max_model_len=256,
                           budget_bytes=4096, block_size=16)


def homogeneity_p_value(table: torch.Tensor) -> float:
    """Pearson's chi-squared test that the rows of a contingency table [2, cells] come from one
    distribution; cells expected to hold fewer than 5 in a row are merged into one."""
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    small = (expected < 5).any(0)
    if small.any():
        table = torch.cat([table[:, ~small], table[:, small].sum(1, keepdim=True)], 1)
        expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    statistic = ((table - expected) ** 2 / expected).sum()
    dof = max(table.shape[1] - 1, 1)
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), statistic / 2))


# The tests below fail falsely with probability 1e-4 per position compared; their draws are
# seeded, so a run that passes passes every time.
FALSE_ALARM = 1e-4


def token_frequencies_match(expected: list[tuple[int, ...]], got: list[tuple[int, ...]], positions: range) -> None:
    assert len(got) == len(expected)
    for position in positions:
        tokens = sorted({t[position] for t in expected + got})
        table = torch.tensor([[sum(t[position] == token for t in run) for token in tokens] for run in (expected, got)],
                             dtype=torch.float64)
        assert homogeneity_p_value(table) > FALSE_ALARM, position


def test_sampled_tokens_have_the_plain_distribution_on_a_tiny_model(tiny_model_factory):
    """Three tokens made likely by a logit bias, and a prompt that repeats them: prompt lookup
    proposes one of them at nearly every step, so many proposals are rejected and the tokens
    after a rejection (the residual draws) make up much of what is compared. A presence
    penalty makes each position's distribution depend on the tokens before it, the proposals
    a row is verified after included."""
    model = tiny_model_factory("llama")
    bias = {10: 8.0, 11: 7.5, 12: 7.0}
    samples = 1500
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=6, ignore_eos=True, logit_bias=bias,
                             presence_penalty=1.0) for i in range(samples)]
    prompt = [10, 11, 12] * 8
    options = {"model": str(model), "kv_cache_memory": "64MiB", "max_model_len": 64, "max_num_seqs": 256}
    with LLM(**options) as plain:
        expected = [o.outputs[0].token_ids for o in plain.generate([prompt] * samples, params, use_tqdm=False)]
    config = {**NGRAM, "prompt_lookup_min": 1, "disable_by_batch_size": 256}
    with LLM(speculative_config=config, **options) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate([prompt] * samples, params, use_tqdm=False)]
        stats = llm.llm_engine.statistics().spec_decode
    assert stats is not None and stats.num_draft_tokens > samples
    assert 0.1 < stats.acceptance_rate < 0.9  # many rejections: the residual draws are tested
    token_frequencies_match(expected, got, range(6))


@pytest.mark.default_model
@pytest.mark.slow
def test_sampled_tokens_have_the_plain_distribution():
    prompt = "Repeat the list: red, green, blue, red, green, blue, red, green, blue. List:"
    samples = 600
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=6, ignore_eos=True) for i in range(samples)]
    options = {"kv_cache_memory": "256MiB", "max_model_len": 256}
    with LLM(**options) as plain:
        expected = [o.outputs[0].token_ids for o in plain.generate([prompt] * samples, params, use_tqdm=False)]
    config = {**NGRAM, "prompt_lookup_min": 1, "disable_by_batch_size": samples}
    with LLM(speculative_config=config, **options) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate([prompt] * samples, params, use_tqdm=False)]
        stats = llm.llm_engine.statistics().spec_decode
    assert stats is not None and stats.num_accepted_tokens > samples // 2  # speculation did run
    token_frequencies_match(expected, got, range(1, 6))
