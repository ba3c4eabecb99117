"""Unit tests: the engine's and the server's settings as users give them. EngineArgs options (an unknown one,
vLLM-only ones included, is named); what triode reads from a model's config.json and
generation_config.json (triode.engine.model.generation_config): every end-of-sequence id, sampling
defaults, the ``--generation-config`` modes, malformed files named in the error; and the
server's request parsing applying those defaults only to the fields a request leaves unset;
whether requests may bring a chat template. Values of the wrong type, in EngineArgs and
SamplingParams alike, are refused naming the field (triode.field_types)."""

from __future__ import annotations

import json
import re

import pytest

from triode.engine.config import EngineArgs
from triode.engine.errors import InvalidRequestError, ModelLoadError
from triode.engine.model.generation_config import read_generation_defaults
from triode.engine.sampling_params import SamplingParams
from triode.frontend.openai.errors import APIError
from triode.frontend.openai.requests import parse_chat, parse_completion
from triode.frontend.server.settings import ServerSettings


def model_dir(tmp_path, config_eos=None, generation=None):
    config = {"architectures": ["LlamaForCausalLM"]}
    if config_eos is not None:
        config["eos_token_id"] = config_eos
    (tmp_path / "config.json").write_text(json.dumps(config))
    if generation is not None:
        text = generation if isinstance(generation, str) else json.dumps(generation)
        (tmp_path / "generation_config.json").write_text(text)
    return tmp_path


def test_every_eos_id_of_both_files_with_the_tokenizers_first(tmp_path):
    path = model_dir(tmp_path, config_eos=[128001, 128008, 128009],
                     generation={"eos_token_id": [128009, 128010], "temperature": 0.6, "top_p": 0.9})
    defaults = read_generation_defaults(path, tokenizer_eos_token_id=128009)
    assert defaults.eos_token_ids == (128009, 128001, 128008, 128010)
    assert dict(defaults.sampling) == {"temperature": 0.6, "top_p": 0.9}
    assert defaults.source == str(path / "generation_config.json")
    params = defaults.sampling_params(max_tokens=5)
    assert (params.temperature, params.top_p, params.top_k, params.max_tokens) == (0.6, 0.9, 0, 5)
    assert "temperature=0.6" in defaults.describe() and "128010" in defaults.describe()


def test_an_int_eos_and_no_generation_config(tmp_path):
    defaults = read_generation_defaults(model_dir(tmp_path, config_eos=2), tokenizer_eos_token_id=None)
    assert defaults.eos_token_ids == (2,) and defaults.sampling == () and defaults.source is None
    assert defaults.sampling_params().temperature == 1.0  # vLLM's default


def test_vllm_mode_drops_the_sampling_defaults_but_keeps_every_eos_id(tmp_path):
    path = model_dir(tmp_path, config_eos=1, generation={"eos_token_id": 5, "top_k": 20})
    defaults = read_generation_defaults(path, mode="vllm", tokenizer_eos_token_id=1)
    assert defaults.eos_token_ids == (1, 5) and defaults.sampling == ()


def test_a_folder_mode_reads_that_folders_file(tmp_path):
    (tmp_path / "model").mkdir()
    path = model_dir(tmp_path / "model", generation={"temperature": 0.2})
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"min_p": 0.05, "repetition_penalty": 1.1}))
    defaults = read_generation_defaults(path, mode=str(other))
    assert dict(defaults.sampling) == {"min_p": 0.05, "repetition_penalty": 1.1}
    with pytest.raises(ModelLoadError, match=r"a folder without generation_config\.json"):
        read_generation_defaults(path, mode=str(tmp_path / "missing"))


@pytest.mark.parametrize(("generation", "message"), [
    ("{not json", "cannot read it"),
    ("[1, 2]", "expected a JSON object"),
    ({"temperature": "hot"}, "temperature must be a number"),
    ({"top_k": 2.5}, "top_k must be a number"),
    ({"top_p": 1.5}, "an invalid sampling default: top_p"),
    ({"eos_token_id": ["x"]}, "eos_token_id must be a token id"),
])
def test_a_malformed_generation_config_is_reported_with_its_file(tmp_path, generation, message):
    path = model_dir(tmp_path, generation=generation)
    with pytest.raises(ModelLoadError, match=message) as error:
        read_generation_defaults(path)
    assert str(path / "generation_config.json") in str(error.value)


def test_an_empty_generation_config_setting_is_refused():
    with pytest.raises(InvalidRequestError) as error:
        EngineArgs(generation_config="")
    assert error.value.field == "generation_config"
    assert EngineArgs.from_env({"TRIODE_GENERATION_CONFIG": "vllm"}).generation_config == "vllm"


def test_unknown_engine_arguments_are_named():
    with pytest.raises(InvalidRequestError, match=r"swap_space: .*recomputed") as error:
        EngineArgs.from_options(model=None, swap_space=4)
    assert error.value.field == "swap_space"
    with pytest.raises(InvalidRequestError, match=r"max_num_seq: unknown.*max_num_seqs"):
        EngineArgs.from_options(max_num_seq=4)
    assert EngineArgs.from_options(max_num_seqs=4).max_num_seqs == 4


# Each once passed its range check and failed later: inside a worker step, on every retry of it
# until the engine died (top_k=1.5, seed=1.5, logprobs=True), in an actor (stop=[1, 2],
# skip_special_tokens=None, n=2.5), in a loop that never ended (n=10**30), or as a bare
# TypeError or AttributeError deep inside.
WRONG_SAMPLING = [
    ({"top_k": 1.5}, "top_k: expected an integer, got float 1.5"),
    ({"seed": 1.5}, "seed: expected an integer or None"),
    ({"logprobs": True}, "logprobs: expected an integer or None, got bool True"),
    ({"n": 2.5}, "n: expected an integer"),
    ({"n": 10**30}, "n: must be in [1, 128]"),
    ({"stop": [1, 2]}, "stop: expected a string or a list of strings"),
    ({"stop": b"x"}, "stop: expected a string or a list of strings, got bytes"),
    ({"stop_token_ids": ["a"]}, "stop_token_ids: expected a list of integers"),
    ({"skip_special_tokens": None}, "skip_special_tokens: expected true or false"),
    ({"temperature": None}, "temperature: expected a finite number"),
    ({"temperature": float("inf")}, "temperature: expected a finite number, got float inf"),
    ({"temperature": 10**400}, "temperature: expected a finite number, got int"),  # once an OverflowError
    ({"top_p": "0.5"}, "top_p: expected a finite number, got str"),
    ({"logit_bias": {"a": 1}}, "logit_bias: keys must be token ids, got 'a'"),
    ({"logit_bias": {1: float("nan")}}, "logit_bias: the bias of token 1 must be a finite number"),
    ({"output_kind": "delta"}, "output_kind: expected an OutputKind"),
]
WRONG_ENGINE = [
    ({"step_timeout": float("nan")}, "step_timeout: expected a number, got float nan"),
    ({"block_size": 3.5}, "block_size: expected an integer"),
    ({"max_model_len": "100"}, "max_model_len: expected an integer or None, got str"),
    ({"max_model_len": True}, "max_model_len: expected an integer or None, got bool"),
    ({"model": 123}, "model: expected a string or None"),
    ({"kv_cache_memory": 2.5e8}, "kv_cache_memory: 250000000.0 is not a size"),
    ({"enable_lora": "no"}, "enable_lora: expected true or false, got str"),
    ({"seed": "x"}, "seed: expected an integer, got str"),
]


@pytest.mark.parametrize(("options", "message"), WRONG_SAMPLING + WRONG_ENGINE)
def test_values_of_the_wrong_type_are_refused_naming_the_field(options, message):
    kind = SamplingParams if (options, message) in WRONG_SAMPLING else EngineArgs
    with pytest.raises(InvalidRequestError) as error:
        kind(**options)
    assert str(error.value).startswith(message) and error.value.field == next(iter(options))


def test_an_empty_variable_is_unset():
    """TRIODE_MODEL= (an empty value in a unit file) loaded the current directory as the model."""
    assert EngineArgs.from_env({"TRIODE_MODEL": "", "TRIODE_MAX_NUM_SEQS": ""}) == EngineArgs()


def test_the_types_a_field_admits_still_pass():
    assert SamplingParams(temperature=0, top_p=1, logit_bias={"5": 2}, stop=("a",), seed=None).temperature == 0
    assert EngineArgs(kv_cache_memory="1GiB", step_timeout=5, gpu_memory_utilization=0.5).step_timeout == 5


def test_server_requests_take_the_defaults_only_where_unset(tmp_path):
    path = model_dir(tmp_path, generation={"temperature": 0.6, "top_p": 0.9, "top_k": 20})
    defaults = read_generation_defaults(path)
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    unset = parse_chat(chat, defaults).params
    assert (unset.temperature, unset.top_p, unset.top_k, unset.min_p) == (0.6, 0.9, 20, 0.0)
    given = parse_chat({**chat, "temperature": 0.0, "top_k": -1}, defaults).params
    assert (given.temperature, given.top_p, given.top_k) == (0.0, 0.9, -1)
    completion = parse_completion({"prompt": "x", "top_p": 0.5}, defaults).params
    assert (completion.temperature, completion.top_p) == (0.6, 0.5)
    assert parse_chat(chat, None).params.temperature == 1.0  # no model loaded yet: vLLM's
    with pytest.raises(APIError):
        parse_chat({**chat, "chat_template_kwargs": ["not", "a", "mapping"]}, defaults)


def test_request_chat_templates_are_trusted_only_when_asked():
    assert not ServerSettings.from_env({}).trust_request_chat_template
    assert ServerSettings.from_env({"TRIODE_TRUST_REQUEST_CHAT_TEMPLATE": "yes"}).trust_request_chat_template
    assert ServerSettings.from_env({"TRIODE_TRUST_REQUEST_CHAT_TEMPLATE": "1"},
                                   trust_request_chat_template=False).trust_request_chat_template is False
    with pytest.raises(InvalidRequestError, match="not a boolean"):
        ServerSettings.from_env({"TRIODE_TRUST_REQUEST_CHAT_TEMPLATE": "maybe"})


def test_development_mode_is_off_unless_asked_under_triodes_or_vllms_name():
    assert not ServerSettings.from_env({}).server_dev_mode
    assert ServerSettings.from_env({"TRIODE_SERVER_DEV_MODE": "1"}).server_dev_mode
    assert ServerSettings.from_env({"VLLM_SERVER_DEV_MODE": "1"}).server_dev_mode
    assert not ServerSettings.from_env({"VLLM_SERVER_DEV_MODE": "1"}, server_dev_mode=False).server_dev_mode


def test_tool_reasoning_and_template_settings(tmp_path):
    settings = ServerSettings.from_env({"TRIODE_TOOL_CALL_PARSER": "hermes", "TRIODE_ENABLE_AUTO_TOOL_CHOICE": "on"})
    assert (settings.tool_call_parser, settings.enable_auto_tool_choice) == ("hermes", True)
    assert EngineArgs.from_env({"TRIODE_REASONING_PARSER": "qwen3"}).reasoning_parser == "qwen3"
    with pytest.raises(InvalidRequestError, match="tool_call_parser: expected one of hermes, llama3_json, mistral"):
        ServerSettings(tool_call_parser="pythonic")
    with pytest.raises(InvalidRequestError, match="needs --tool-call-parser"):
        ServerSettings(enable_auto_tool_choice=True)
    with pytest.raises(InvalidRequestError, match="reasoning_parser must be one of deepseek_r1, qwen3"):
        EngineArgs(reasoning_parser="o1")
    template = tmp_path / "t.jinja"
    template.write_text("{{ messages[0]['content'] }}")
    assert ServerSettings.from_env({}, chat_template=str(template)).chat_template == template.read_text()
    assert ServerSettings(chat_template="{% for m in messages %}{% endfor %}").chat_template.startswith("{%")
    with pytest.raises(InvalidRequestError, match="neither a file nor a Jinja template"):
        ServerSettings(chat_template=str(tmp_path / "missing.jinja"))


def test_every_serve_option_names_its_default_once():
    from triode.frontend.cli import build_parser

    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    helps = [action.help for action in serve._actions if action.help and action.option_strings]
    assert len(helps) > 40
    for text in helps:  # a text that names its default is not given a second "(default: ...)"
        assert re.search(r"\(default.*\) \(default: [^)]*\)$", text) is None, text
