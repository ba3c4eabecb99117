"""contract: the decode stack (every decoder layer of a decode step in one C call,
``kernels.DecodeStack``) against the model's own modules, on real runners of tiny quantized
models: the same tokens and bit for bit the same logprobs, with float32, int8 and (on CPUs with
the interleaved kernels) int16 activations, for a batch of one (attention split by KV head)
and a batch of several (past FUSED_ROWS with interleaved weights), for matrices of one
block type and for q / k / v in three, for teams of one to three threads, and with attention
biases (Qwen2). Models and steps
it does not compute exactly as the modules do run the modules; bad step metadata fails with
a ValueError naming what is wrong, before anything is written.
"""

from __future__ import annotations

import dataclasses

import attrs
import pytest
import torch

from tests.driver import Driver
from tests.gguf_models import tiny_quantizable_llama, write_tiny_gguf
from tests.hf_compare import TINY_MODEL_TEXTS, greedy_params
from triode import kernels
from triode.bench.lora import write_random_adapter
from triode.engine.config import EngineArgs
from triode.engine.lora.request import LoRARequest
from triode.engine.model_files.resolve import resolve_model
from triode.engine.worker.models.cpu_decode import decode_stack_supported
from triode.engine.worker.runner import ModelRunner
from triode.kernels.decode_stack import DecodeStack
from triode.kernels.quant_linear import (
    FUSED_ROWS,
    interleaved_kernels_available,
    quantized_kernels_available,
    set_quantized_activations,
)

pytestmark = pytest.mark.skipif(not quantized_kernels_available(), reason="no AVX2 or no C compiler")

MAX_TOKENS = 12
MIXED = {"attn_q": "Q8_0", "attn_k": "Q4_0", "attn_v": "Q6_K", "ffn_down": "Q4_K"}
INT16 = pytest.param("int16", marks=pytest.mark.skipif(not interleaved_kernels_available(),
                                                         reason="this CPU has no interleaved kernels (AVX2 and a C compiler)"))


@pytest.fixture(scope="module", params=["Q4_1", "mixed"])
def gguf_entry(request, tmp_path_factory, tiny_tokenizer):
    directory = tmp_path_factory.mktemp(f"stack-{request.param}")
    path = directory / "tiny.gguf"
    kinds = MIXED if request.param == "mixed" else None
    write_tiny_gguf(path, tiny_quantizable_llama(tiny_tokenizer), tiny_tokenizer, "Q4_1", kinds)
    return resolve_model(str(path), cache_dir=str(directory / "cache"), progress=False).path


@pytest.fixture(scope="module")
def qwen2_int8_entry(tiny_model_factory, tmp_path_factory):
    source = tiny_model_factory("qwen2")
    cache = tmp_path_factory.mktemp("stack-qwen2")
    return resolve_model(str(source), cache_dir=str(cache), progress=False, quantization="int8").path


@pytest.fixture
def stack_calls(monkeypatch):
    """How many steps went through DecodeStack.run."""
    calls = []
    run = DecodeStack.run

    def counted(self, *args, **kwargs):
        calls.append(args[0].shape[0])
        return run(self, *args, **kwargs)

    monkeypatch.setattr(DecodeStack, "run", counted)
    return calls


def _runner(entry, activations="float32") -> ModelRunner:
    args = EngineArgs(model=str(entry), kv_cache_memory=64 << 20, max_model_len=512,
                      quantized_activations=activations)
    return ModelRunner(args, entry)


def _generate(runner, prompts, *, stack: bool):
    runner.model.decode_stack_enabled = stack
    return Driver(runner).generate(prompts, attrs.evolve(greedy_params(MAX_TOKENS), logprobs=5))


@pytest.fixture(autouse=True)
def _float32_activations_after():
    yield
    set_quantized_activations("float32")


@pytest.mark.parametrize("activations", ["float32", "int8", INT16])
@pytest.mark.parametrize("batch", [1, 4])
def test_stack_gives_the_modules_results_bit_for_bit(gguf_entry, tiny_tokenizer, stack_calls, activations, batch):
    runner = _runner(gguf_entry, activations)
    assert decode_stack_supported(runner.model)
    prompts = [tiny_tokenizer.encode(text) for text in TINY_MODEL_TEXTS[:batch]]
    with_stack = _generate(runner, prompts, stack=True)
    assert stack_calls == [batch] * (MAX_TOKENS - 1), "every decode step, no prefill step"
    assert _generate(runner, prompts, stack=False) == with_stack
    assert len(stack_calls) == MAX_TOKENS - 1


@pytest.mark.parametrize("activations", ["int8", INT16])
def test_interleaved_weights_take_batches_past_fused_rows(gguf_entry, tiny_tokenizer, stack_calls, activations):
    runner = _runner(gguf_entry, activations)
    if not any(part.interleaved for m in runner.model.modules() for part in getattr(m, "parts", None) or ()):
        pytest.skip("this CPU keeps GGUF's layout (no interleaved kernels)")
    batch = FUSED_ROWS + 3
    prompts = [[*tiny_tokenizer.encode(TINY_MODEL_TEXTS[i % len(TINY_MODEL_TEXTS)]), i + 3] for i in range(batch)]
    with_stack = _generate(runner, prompts, stack=True)
    assert stack_calls == [batch] * (MAX_TOKENS - 1)
    assert _generate(runner, prompts, stack=False) == with_stack


@pytest.mark.parametrize("threads", [1, 3])
def test_any_team_size_gives_the_same_results(gguf_entry, tiny_tokenizer, stack_calls, threads):
    # The stack's team splits each matrix into one share per thread and lets a thread that is
    # done take chunks of the others' shares: three threads on two cores make them steal.
    runner = _runner(gguf_entry, "int8")
    prompts = [tiny_tokenizer.encode(text) for text in TINY_MODEL_TEXTS[:3]]
    expected = _generate(runner, prompts, stack=False)
    default = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert _generate(runner, prompts, stack=True) == expected
    finally:
        torch.set_num_threads(default)
    assert stack_calls


def test_lora_adapters_give_the_modules_results_bit_for_bit(gguf_entry, tiny_tokenizer, stack_calls, tmp_path):
    """A batch mixing two adapters and the base model (the adapters' stacks in bfloat16 over
    the quantized weights), through the stack and through the modules."""
    args = EngineArgs(model=str(gguf_entry), kv_cache_memory=64 << 20, max_model_len=512, enable_lora=True,
                      max_loras=2, quantized_activations="float32")
    runner = ModelRunner(args, gguf_entry)
    assert decode_stack_supported(runner.model)
    adapters = [LoRARequest(f"a{i}", i + 1, str(write_random_adapter(tmp_path / f"a{i}", runner.config, rank=8,
                                                                      seed=i, scale=8.0)))
                for i in range(2)]
    prompts = [tiny_tokenizer.encode(text) for text in TINY_MODEL_TEXTS[:4]]
    loras = [adapters[0], None, adapters[1], adapters[0]]
    runner.model.decode_stack_enabled = True
    with_stack = Driver(runner).generate(prompts, attrs.evolve(greedy_params(MAX_TOKENS), logprobs=5), loras=loras)
    assert stack_calls == [4] * (MAX_TOKENS - 1)
    runner.model.decode_stack_enabled = False
    assert Driver(runner).generate(prompts, attrs.evolve(greedy_params(MAX_TOKENS), logprobs=5),
                                   loras=loras, name="modules") == with_stack
    base = Driver(runner).generate(prompts, attrs.evolve(greedy_params(MAX_TOKENS), logprobs=5), name="base")
    assert base[1] == with_stack[1]  # the base model's row is untouched by its neighbours' adapters
    assert base[0][0] != with_stack[0][0] and base[2][0] != with_stack[2][0]


def test_attention_biases_ride_along(qwen2_int8_entry, tiny_tokenizer, stack_calls):
    runner = _runner(qwen2_int8_entry)
    assert runner.model.layers[0].self_attn.qkv_proj.bias is not None
    prompts = [tiny_tokenizer.encode(text) for text in TINY_MODEL_TEXTS[:3]]
    assert _generate(runner, prompts, stack=True) == _generate(runner, prompts, stack=False)
    assert stack_calls


def test_models_it_would_not_compute_exactly_run_the_modules(gguf_entry, tiny_model_factory, tmp_path):
    float_runner = ModelRunner(EngineArgs(model=str(gguf_entry), kv_cache_memory=64 << 20, max_model_len=512,
                                          dtype="float32"), gguf_entry)
    assert not decode_stack_supported(float_runner.model), "dequantized weights: no quantized parts"
    qwen3 = resolve_model(str(tiny_model_factory("qwen3")), cache_dir=str(tmp_path), progress=False,
                          quantization="int8").path
    assert not decode_stack_supported(_runner(qwen3).model), "per-head q/k norms run in the modules"


def test_the_torch_backend_and_prefill_steps_take_the_modules(gguf_entry, tiny_tokenizer, stack_calls):
    runner = _runner(gguf_entry)
    prompts = [tiny_tokenizer.encode(text) for text in TINY_MODEL_TEXTS[:2]]
    kernels.set_backend("torch")
    try:
        _generate(runner, prompts, stack=True)
    finally:
        kernels.set_backend("auto")
    assert stack_calls == []


def _decode_step(runner, tiny_tokenizer):
    """A prefill through the runner, then the stack, the embedded token and the metadata of the
    first decode step, as the model's forward would see them."""
    from triode.engine.worker.step_inputs import StepInputs
    from triode.engine.worker_messages import ScheduledChunk

    driver = Driver(runner)
    prompt = tiny_tokenizer.encode(TINY_MODEL_TEXTS[0])
    sampled = driver.run([ScheduledChunk(seq_id="a", token_ids=tuple(prompt), start_position=0,
                                         new_block_ids=driver._blocks_for("a", len(prompt) + 1))],
                         [_new("a", prompt)])
    chunk = ScheduledChunk(seq_id="a", token_ids=(sampled["a"][0],), start_position=len(prompt))
    inputs = StepInputs.build([chunk], [chunk.token_ids], runner.block_tables,
                              block_size=runner.block_size, device=runner.device)
    stack = runner.model._decode_stack_for(runner.kv_caches)
    assert stack is not None and stack.takes(1, inputs.metadata, runner.kv_caches)
    return stack, runner.model.embed_tokens(inputs.token_ids), inputs


def _new(seq_id, prompt):
    from triode.engine.worker_messages import NewSequence

    return NewSequence(seq_id=seq_id, prompt_token_ids=tuple(prompt), params=greedy_params(MAX_TOKENS))


def test_bad_metadata_fails_naming_it_before_anything_is_written(gguf_entry, tiny_tokenizer):
    runner = _runner(gguf_entry)
    stack, hidden, inputs = _decode_step(runner, tiny_tokenizer)
    caches = [k.clone() for k, _ in runner.kv_caches]
    too_far = torch.full_like(inputs.positions, runner.model.rope_cache.shape[0])
    with pytest.raises(ValueError, match="rotary"):
        stack.run(hidden, too_far, inputs.metadata)
    bad_blocks = dataclasses.replace(inputs.metadata, block_tables=inputs.metadata.block_tables + 10**6)
    with pytest.raises(ValueError, match="block ids"):
        stack.run(hidden, inputs.positions, bad_blocks)
    with pytest.raises(ValueError, match="hidden"):
        stack.run(hidden[:, :-1], inputs.positions, inputs.metadata)
    assert all(torch.equal(before, k) for before, (k, _) in zip(caches, runner.kv_caches, strict=True))
    assert not stack.takes(1, inputs.metadata, list(runner.kv_caches)), "other caches: the modules"
