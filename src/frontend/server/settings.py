"""Server settings that are not engine arguments: API keys, the request body limit, whether
requests may bring their own chat template, the server's chat template, the tool-call
parser (vLLM's ``--chat-template``, ``--tool-call-parser``, ``--enable-auto-tool-choice``),
the bounds of the Responses API's store, and the LoRA adapters served by name
(``--lora-modules``) and whether clients may load more (vLLM's
``VLLM_ALLOW_RUNTIME_LORA_UPDATING``, also read here), and whether the development endpoints
are served (vLLM's ``VLLM_SERVER_DEV_MODE``, also read here).
``--reasoning-parser`` is an engine argument, as in vLLM: the engine lets a constrained
output think first.

Read from ``TRIODE_API_KEY`` (one key, or several separated by commas),
``TRIODE_MAX_BODY_SIZE`` (bytes, or with a unit such as ``8MiB``) and ``TRIODE_<FIELD>`` for
the others; ``triode serve`` flags win.

A chat template is a Jinja program: rendered in a sandbox, it still runs for as long as its
loops say, in the intake thread every request shares. So, as vLLM does, a request's
``chat_template`` is refused unless the server trusts its clients
(``--trust-request-chat-template``); ``chat_template_kwargs`` (plain variables) are always
taken."""

from __future__ import annotations

import json
import os
import shlex
from collections.abc import Mapping, Sequence
from pathlib import Path

import attrs

from triode.engine.config import EngineArgs, parse_size
from triode.engine.errors import InvalidRequestError
from triode.engine.model_files.default_model import DEFAULT_MODEL_NAME

DEFAULT_MAX_BODY_BYTES = 8 << 20
DEFAULT_RESPONSES_STORE_SIZE = 1000  # responses
DEFAULT_RESPONSES_STORE_MAX_AGE = 3600.0  # seconds


def _keys(value: Sequence[str] | None) -> tuple[str, ...]:
    return tuple(k for k in (value or ()) if k)


_BOOLEANS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False,
             "off": False, "": False}


def boolean_word(text: str) -> bool | None:
    """A switch's value as written in a variable or a query (1, true, yes, on; 0, false, no,
    off, or nothing), None for any other word."""
    return _BOOLEANS.get(text.strip().lower())


def _tool_parser(instance: object, attribute: attrs.Attribute, value: str | None) -> None:
    from triode.frontend.openai.tool_parsers import TOOL_PARSERS

    if value is not None and value not in TOOL_PARSERS:
        raise InvalidRequestError(f"tool_call_parser: expected one of {', '.join(sorted(TOOL_PARSERS))}, "
                                  f"got {value!r}", field="tool_call_parser")


def _at_least(low: float):
    def check(instance: object, attribute: attrs.Attribute, value: float) -> None:
        if isinstance(value, bool) or not isinstance(value, int | float) or value < low:
            raise InvalidRequestError(f"{attribute.name}: expected a number >= {low:g}, got {value!r}",
                                      field=attribute.name)
    return check


def read_chat_template(value: str | None) -> str | None:
    """``--chat-template``: a file's path, or the template itself (vLLM reads it the same way)."""
    if value is None or not value.strip():
        return None
    path = Path(value).expanduser()
    if len(value) < 4096 and "\n" not in value and path.is_file():
        return path.read_text()
    if "{{" not in value and "{%" not in value:
        raise InvalidRequestError(f"chat_template: {value!r} is neither a file nor a Jinja template",
                                  field="chat_template")
    return value


@attrs.frozen(kw_only=True)
class LoRAModule:
    """An adapter served under ``name`` from ``path`` (vLLM's ``LoRAModulePath``)."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(value: str | Mapping[str, object] | LoRAModule) -> LoRAModule:
    """``name=path``, or a JSON object with ``name``, ``path`` and ``base_model_name``, as
    vLLM's ``--lora-modules`` takes them."""
    if isinstance(value, LoRAModule):
        return value
    if isinstance(value, str) and value.lstrip().startswith("{"):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise InvalidRequestError(f"lora_modules: {value!r} is not a JSON object ({e})", field="lora_modules") from None
    if isinstance(value, Mapping):
        name, path, base = value.get("name"), value.get("path"), value.get("base_model_name")
        unknown = set(value) - {"name", "path", "base_model_name"}
        if unknown or not isinstance(name, str) or not isinstance(path, str) or not (base is None or isinstance(base, str)):
            raise InvalidRequestError(f"lora_modules: {dict(value)!r} needs string 'name' and 'path' (and may have "
                                      f"'base_model_name')", field="lora_modules")
        return LoRAModule(name=name, path=path, base_model_name=base)
    name, equals, path = str(value).partition("=")
    if not equals or not name or not path:
        raise InvalidRequestError(f"lora_modules: {value!r} is neither name=path nor a JSON object",
                                  field="lora_modules")
    return LoRAModule(name=name, path=path)


def _lora_modules(values: Sequence[str | Mapping[str, object] | LoRAModule] | None) -> tuple[LoRAModule, ...]:
    modules = tuple(parse_lora_module(value) for value in values or ())
    names = [module.name for module in modules]
    for name in names:
        if names.count(name) > 1:
            raise InvalidRequestError(f"lora_modules: the name {name!r} is given twice", field="lora_modules")
    return modules


@attrs.frozen(kw_only=True)
class ServerSettings:
    api_keys: tuple[str, ...] = attrs.field(default=(), converter=_keys)
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    trust_request_chat_template: bool = False
    chat_template: str | None = attrs.field(default=None, converter=read_chat_template)
    tool_call_parser: str | None = attrs.field(default=None, validator=_tool_parser)
    enable_auto_tool_choice: bool = False
    # /v1/responses with store: how many responses are kept, and for how long (0: none kept)
    responses_store_size: int = attrs.field(default=DEFAULT_RESPONSES_STORE_SIZE, validator=_at_least(0))
    responses_store_max_age: float = attrs.field(default=DEFAULT_RESPONSES_STORE_MAX_AGE, validator=_at_least(1e-3))
    # LoRA adapters served from start-up, selected by a request's "model" (needs --enable-lora)
    lora_modules: tuple[LoRAModule, ...] = attrs.field(default=(), converter=_lora_modules)
    # POST /v1/load_lora_adapter and /v1/unload_lora_adapter exist (vLLM's switch is an
    # environment variable, VLLM_ALLOW_RUNTIME_LORA_UPDATING, read here too)
    allow_runtime_lora_updating: bool = False
    # POST /reset_prefix_cache exists (vLLM serves it only in its development mode,
    # VLLM_SERVER_DEV_MODE, read here too): any client could empty the cache others rely on
    server_dev_mode: bool = False

    def __attrs_post_init__(self) -> None:
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise InvalidRequestError("enable_auto_tool_choice: needs --tool-call-parser to find the calls",
                                      field="enable_auto_tool_choice")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **given: object) -> ServerSettings:
        """Each field from its flag (``given``, None: not given) or else ``TRIODE_<FIELD>``
        (``TRIODE_API_KEY`` holds one key or several, comma-separated)."""
        environ = os.environ if environ is None else environ
        values: dict[str, object] = {}
        for field in attrs.fields(cls):
            value = given.get(field.name)
            env = _ENV_NAMES.get(field.name, f"TRIODE_{field.name.upper()}")
            raw = environ.get(env)
            if raw is None and field.name in _VLLM_ENV_NAMES:
                env = _VLLM_ENV_NAMES[field.name]
                raw = environ.get(env)
            if value is None and raw is not None:
                value = _from_text(field, env, raw)
            if value is not None:
                values[field.name] = value
        return cls(**values)


_ENV_NAMES = {"api_keys": "TRIODE_API_KEY", "max_body_bytes": "TRIODE_MAX_BODY_SIZE"}
_VLLM_ENV_NAMES = {"allow_runtime_lora_updating": "VLLM_ALLOW_RUNTIME_LORA_UPDATING",
                   "server_dev_mode": "VLLM_SERVER_DEV_MODE"}


def _from_text(field: attrs.Attribute, env: str, raw: str) -> object:
    if field.name == "api_keys":
        return [key.strip() for key in raw.split(",")]
    if field.name == "lora_modules":
        return shlex.split(raw)  # name=path entries, or JSON objects in quotes
    if field.name == "max_body_bytes":
        try:
            return parse_size(raw) if raw else DEFAULT_MAX_BODY_BYTES
        except ValueError as e:
            raise InvalidRequestError(f"{env}: {e}", field="max_body_size") from None
    if str(field.type) in ("int", "float"):
        try:
            return int(raw) if str(field.type) == "int" else float(raw)
        except ValueError:
            raise InvalidRequestError(f"{env}={raw!r} is not a number", field=field.name) from None
    if str(field.type).startswith("bool"):
        if (switch := boolean_word(raw)) is None:
            raise InvalidRequestError(f"{env}={raw!r} is not a boolean", field=field.name)
        return switch
    return raw or None


def served_model_name(args: EngineArgs) -> str:
    """The name clients send and see: --served-model-name, else the model argument (the
    default model's own name when none is given)."""
    if args.served_model_name:
        return args.served_model_name
    return DEFAULT_MODEL_NAME if args.model in (None, "default") else args.model
