"""Contract tests of LoRA adapters (real worker processes, tiny random models): greedy tokens
identical to PEFT's ``PeftModel`` and logprobs within 1e-3 in float32, for the Llama, Qwen3 and
Gemma families at ranks 8 and 16 (and rsLoRA); a batch mixing three adapters and the base model
equal to each run alone; adapters in more steps than slots; the prefix cache never shared
across adapters; and the errors a wrong adapter gets."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.hf_compare import TINY_MODEL_TEXTS, assert_matches_hf, greedy_params, hf_greedy
from tests.lora_adapters import build_adapter
from triode import LLM, EngineArgs, LoRAAdapterError, LoRARequest, SamplingParams
from triode.engine.errors import InvalidRequestError
from triode.engine.worker_messages import TokenLogprobs

pytestmark = pytest.mark.contract

MAX_TOKENS = 12


def _as_token_logprobs(output) -> tuple[list[int], list[TokenLogprobs]]:
    completion = output.outputs[0]
    assert len(completion.logprobs) == len(completion.token_ids)
    rows = []
    for token, entries in zip(completion.token_ids, completion.logprobs, strict=True):
        rows.append(TokenLogprobs(token_id=token, logprob=entries[token].logprob, rank=entries[token].rank,
                                  top=tuple((t, lp.logprob) for t, lp in entries.items() if t != token)))
    return list(completion.token_ids), rows


@pytest.fixture(scope="module")
def adapters_of(tiny_model_factory, tmp_path_factory):
    """family -> (base path, {name: LoRARequest}): ranks 8 and 16 of every target module, and an
    rsLoRA adapter of the attention only."""
    built = {}

    def of(family: str):
        if family not in built:
            base = tiny_model_factory(family)
            root = tmp_path_factory.mktemp(f"lora-{family}")
            specs = {"r8": dict(rank=8, seed=1), "r16": dict(rank=16, seed=2),
                     "rs": dict(rank=4, seed=3, use_rslora=True, targets=("q_proj", "v_proj", "o_proj"))}
            requests = {name: LoRARequest(name, index + 1, str(build_adapter(base, root / name, scale=3.0, **spec)))
                        for index, (name, spec) in enumerate(specs.items())}
            built[family] = (base, requests)
        return built[family]

    return of


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma2"])
def test_greedy_matches_peft_and_a_mixed_batch_matches_each_alone(family, adapters_of, tiny_tokenizer):
    base, adapters = adapters_of(family)
    prompts = [tiny_tokenizer.encode(text) for text in TINY_MODEL_TEXTS]
    with LLM(model=str(base), enable_lora=True, max_loras=3, max_lora_rank=16, kv_cache_memory="16MiB",
             max_model_len=256) as llm:
        params = greedy_params(MAX_TOKENS)
        alone = {}
        for name, request in [*adapters.items(), ("base", None)]:
            outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora_request=request,
                                   use_tqdm=False)
            assert len(outputs) == len(prompts)
            alone[name] = [_as_token_logprobs(output) for output in outputs]
        # every prompt under each adapter and the base model, interleaved in one batch
        names = [*adapters, "base"]
        mixed = llm.generate([{"prompt_token_ids": p} for p in prompts for _ in names], params,
                             lora_request=[adapters.get(name) for _ in prompts for name in names], use_tqdm=False)
        assert len(mixed) == len(prompts) * len(names)
    for index, output in enumerate(mixed):
        name, prompt = names[index % len(names)], index // len(names)
        assert list(output.outputs[0].token_ids) == alone[name][prompt][0], (name, prompt)
    assert alone["r8"] != alone["base"] and alone["r16"] != alone["r8"]  # the adapters change the output
    for name, request in adapters.items():
        reference = hf_greedy(base, prompts, MAX_TOKENS, adapter=request.lora_path)
        assert_matches_hf(alone[name], reference)
    assert_matches_hf(alone["base"], hf_greedy(base, prompts, MAX_TOKENS))


def test_more_adapters_than_slots_take_turns(adapters_of, tiny_tokenizer):
    base, adapters = adapters_of("llama")
    prompt = {"prompt_token_ids": tiny_tokenizer.encode(TINY_MODEL_TEXTS[1])}
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with LLM(model=str(base), enable_lora=True, max_loras=1, max_cpu_loras=2, kv_cache_memory="16MiB",
             max_model_len=256) as llm:
        requests = list(adapters.values()) * 2
        outputs = llm.generate([prompt] * len(requests), params, lora_request=requests, use_tqdm=False)
        assert len(outputs) == len(requests)
        alone = {r.lora_int_id: llm.generate(prompt, params, lora_request=r, use_tqdm=False)[0] for r in adapters.values()}
    for request, output in zip(requests, outputs, strict=True):
        assert output.outputs[0].token_ids == alone[request.lora_int_id].outputs[0].token_ids


def test_prefix_cache_is_not_shared_across_adapters(adapters_of, tiny_tokenizer):
    base, adapters = adapters_of("llama")
    shared = {"prompt_token_ids": tiny_tokenizer.encode(TINY_MODEL_TEXTS[2])}  # several full blocks
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    with LLM(model=str(base), enable_lora=True, max_loras=2, kv_cache_memory="16MiB", max_model_len=256) as llm:
        first = llm.generate(shared, params, lora_request=adapters["r8"], use_tqdm=False)[0]
        other = llm.generate(shared, params, lora_request=adapters["r16"], use_tqdm=False)[0]
        again = llm.generate(shared, params, lora_request=adapters["r8"], use_tqdm=False)[0]
        base_run = llm.generate(shared, params, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    assert other.num_cached_tokens == 0  # the same tokens, another adapter: nothing reused
    assert base_run.num_cached_tokens == 0
    assert again.num_cached_tokens > 0  # the same adapter again: its own blocks are hit
    assert again.outputs[0].token_ids == first.outputs[0].token_ids


def _copy_adapter(source: str, target, change=None):
    shutil.copytree(source, target)
    if change is not None:
        config = json.loads((target / "adapter_config.json").read_text())
        change(config)
        (target / "adapter_config.json").write_text(json.dumps(config))
    return str(target)


def _nested(levels: int) -> list:
    value: list = []
    for _ in range(levels):
        value = [value]
    return value


def _with_lm_head(directory: str) -> str:
    """The adapter with an LM-head LoRA too (a target module triode does not adapt)."""
    weights = f"{directory}/adapter_model.safetensors"
    tensors = load_file(weights)
    tensors["base_model.model.lm_head.lora_A.weight"] = torch.zeros(8, 64)
    save_file(tensors, weights)
    return directory


def _with_a_nan(directory: str) -> str:
    """The adapter with one NaN among its lora_B weights."""
    weights = f"{directory}/adapter_model.safetensors"
    tensors = load_file(weights)
    name = sorted(key for key in tensors if "lora_B" in key)[0]
    tensors[name][0, 0] = float("nan")
    save_file(tensors, weights)
    return directory


def test_wrong_adapters_are_clear_errors_naming_them(adapters_of, tiny_model_factory, tmp_path, tiny_tokenizer):
    base, adapters = adapters_of("llama")
    source = adapters["r8"].lora_path
    truncated = _copy_adapter(source, tmp_path / "truncated")
    weights = tmp_path / "truncated" / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    trailing = _copy_adapter(source, tmp_path / "trailing")  # safetensors' reader refuses it in the workers
    weights = tmp_path / "trailing" / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes() + bytes(8))
    other_base = tiny_model_factory("llama", hidden_size=32)
    cases = {
        "rank": (adapters["r16"].lora_path, "its rank 16 exceeds --max-lora-rank 8"),
        "missing": (str(tmp_path / "nowhere"), "is not a directory"),
        "truncated": (truncated, "is truncated"),
        "trailing": (trailing, "8 bytes follow its last tensor"),
        "dora": (_copy_adapter(source, tmp_path / "dora", lambda c: c.update(use_dora=True)), "use_dora=True"),
        "rslora-text": (_copy_adapter(source, tmp_path / "rslora-text", lambda c: c.update(use_rslora="false")),
                        "use_rslora must be true or false, got 'false'"),
        "other-base": (str(build_adapter(other_base, tmp_path / "other-base", rank=4, seed=5)), "another base model"),
        "lm-head": (_with_lm_head(_copy_adapter(source, tmp_path / "lm-head")), "adapts a layer triode does not"),
        "deep-config": (_copy_adapter(source, tmp_path / "deep-config", lambda c: c.update(notes=_nested(500))),
                        "nested more than 64 levels deep"),  # a RecursionError, once: HTTP 500
    }
    prompt = {"prompt_token_ids": tiny_tokenizer.encode("Paris")}
    params = SamplingParams(max_tokens=2)
    with LLM(model=str(base), enable_lora=True, max_lora_rank=8, kv_cache_memory="16MiB", max_model_len=256) as llm:
        for index, (name, (path, reason)) in enumerate(cases.items()):
            with pytest.raises(LoRAAdapterError, match=reason) as caught:
                llm.generate(prompt, params, lora_request=LoRARequest(name, 10 + index, path), use_tqdm=False)
            assert caught.value.adapter == name
        # What the workers cannot read, or refuse once read, ends its request with "abort": files
        # that changed after the check (it used to wait for ever, over HTTP, and LLM.generate
        # raised KeyError), and a NaN weight (every logit of its requests was NaN).
        unreadable = {
            "changed": _copy_adapter(source, tmp_path / "changed"),
            "nan": _with_a_nan(_copy_adapter(source, tmp_path / "nan")),
        }
        engine = llm.llm_engine
        for index, (name, path) in enumerate(unreadable.items()):
            engine.add_request(name, prompt, params, lora_request=LoRARequest(name, 30 + index, path))
        (tmp_path / "changed" / "adapter_model.safetensors").unlink()
        outputs = []
        for _ in range(50):
            outputs += engine.step()
            if not engine.has_unfinished_requests():
                break
        assert sorted(o.request_id for o in outputs) == sorted(unreadable) and all(o.finished for o in outputs)
        for output in outputs:
            assert [(c.finish_reason, c.token_ids) for c in output.outputs] == [("abort", ())], output.request_id
        # nothing was disturbed: the engine still serves, with an adapter too
        assert llm.generate(prompt, params, lora_request=adapters["r8"], use_tqdm=False)[0].outputs[0].token_ids
        with pytest.raises(InvalidRequestError, match="names adapter 'r8'"):
            llm.generate(prompt, params, lora_request=LoRARequest("r8-again", adapters["r8"].lora_int_id, source),
                         use_tqdm=False)
    with LLM(model=str(base), kv_cache_memory="16MiB", max_model_len=256) as llm:
        with pytest.raises(InvalidRequestError, match="enable_lora"):
            llm.generate(prompt, params, lora_request=adapters["r8"], use_tqdm=False)


def test_engine_args_limits():
    with pytest.raises(InvalidRequestError, match="max_cpu_loras"):
        EngineArgs(enable_lora=True, max_loras=4, max_cpu_loras=2)
    with pytest.raises(InvalidRequestError, match="lora_int_id"):
        LoRARequest("a", 0, "/x")


def test_tensor_parallel_shards_the_adapters(adapters_of, tiny_tokenizer):
    """Two ranks, each with its shard of every adapter (B's rows of q/k/v/gate/up, A's columns
    of o/down), give the one-rank tokens, and logprobs within 1e-3."""
    base, adapters = adapters_of("llama")
    prompts = [{"prompt_token_ids": tiny_tokenizer.encode(text)} for text in TINY_MODEL_TEXTS]
    loras = [adapters["r8"], adapters["r16"], None, adapters["rs"], adapters["r8"]]
    results = {}
    for size in (1, 2):
        with LLM(model=str(base), tensor_parallel_size=size, enable_lora=True, max_loras=3, kv_cache_memory="16MiB",
                 max_model_len=256) as llm:
            outputs = llm.generate(prompts, greedy_params(MAX_TOKENS), lora_request=loras, use_tqdm=False)
        assert len(outputs) == len(prompts)
        results[size] = [_as_token_logprobs(output) for output in outputs]
    for (tokens, logprobs), (one_tokens, one_logprobs) in zip(results[2], results[1], strict=True):
        assert tokens == one_tokens
        for ours, theirs in zip(logprobs, one_logprobs, strict=True):
            assert abs(ours.logprob - theirs.logprob) < 1e-3
