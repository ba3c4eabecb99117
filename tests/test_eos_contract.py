"""Contract tests: every end-of-sequence id and generation_config.json through the real engine
(worker processes): a tiny model whose generation_config.json alone names an id the model
emits, and the default model with config.json's ``eos_token_id`` set to ``[0, 2]`` (the
report: it ran past ``<|im_end|>`` into a made-up next turn)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from triode import LLM, EngineArgs, SamplingParams

pytestmark = pytest.mark.contract

PROMPT = "Paris is the capital of"


def copy_model(source: Path, target: Path, **config) -> Path:
    """A copy of the model directory (weights linked, not copied) with config.json changed."""
    target.mkdir()
    for item in source.iterdir():
        if item.suffix == ".safetensors":
            (target / item.name).symlink_to(item)
        else:
            shutil.copy(item, target / item.name)
    raw = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**raw, **config}))
    return target


def test_an_id_only_generation_config_names_stops_and_is_banned_until_min_tokens(tiny_model_factory, tmp_path):
    source = tiny_model_factory("llama")
    with LLM(str(source), kv_cache_memory="16MiB", max_model_len=256) as llm:
        free = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0].token_ids
    eos = free[2]
    first = free.index(eos)
    model = copy_model(source, tmp_path / "eos")
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos], "top_k": 1}))
    with LLM(str(model), kv_cache_memory="16MiB", max_model_len=256) as llm:
        assert eos in llm.llm_engine.generation.eos_token_ids
        stopped = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)[0]
        assert stopped.outputs[0].token_ids == free[: first + 1]
        assert (stopped.outputs[0].finish_reason, stopped.outputs[0].stop_reason) == ("stop", eos)
        held = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=12, min_tokens=first + 2),
                            use_tqdm=False)[0].outputs[0]
        assert eos not in held.token_ids[: first + 2]  # the worker banned it until then
        defaults = llm.get_default_sampling_params()
        assert defaults.top_k == 1 and defaults.temperature == 1.0


@pytest.mark.default_model
def test_the_default_model_with_two_eos_ids_ends_its_turn(tmp_path):
    from triode.engine.model_files.resolve import resolve_model

    source = resolve_model(None, cache_dir=EngineArgs().resolved_cache_dir()).path
    model = copy_model(source, tmp_path / "smollm2", eos_token_id=[0, 2])
    with LLM(str(model), kv_cache_memory="64MiB", max_model_len=512) as llm:
        (output,) = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                             SamplingParams(temperature=0.0, max_tokens=64), use_tqdm=False)
    completion = output.outputs[0]
    assert completion.text == "The capital of France is Paris."
    assert completion.finish_reason == "stop" and completion.stop_reason is None  # <|im_end|>, its own
    assert len(completion.token_ids) < 64
