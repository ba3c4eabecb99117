"""The two generation request shapes: ``/v1/completions`` and ``/v1/chat/completions``.

Each parses a decoded JSON body into prompts (or a chat) and one SamplingParams, with the
output constraint (``response_format``, ``structured_outputs``: ``triode.frontend.openai.structured_request``)
in it; a chat also reads its tools (``triode.frontend.openai.tool_request``) and its messages' tool calls
and tool results. Fields we do not implement (the legacy ``functions``, best_of, suffix) get
a 400 that says so; unknown fields are ignored and logged once. Sampling fields a request
leaves unset take the model's generation_config.json defaults (``--generation-config auto``,
as in vLLM)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import attrs

from triode.engine import json_nesting
from triode.engine.chat_options import ChatOptions, UnsupportedContentError, joined_text
from triode.engine.errors import InvalidRequestError
from triode.engine.model.generation_config import GenerationDefaults
from triode.engine.sampling_params import SamplingParams
from triode.frontend.openai.errors import bad_request
from triode.frontend.openai.request_body import (
    Reader,
    StreamOptions,
    read_prompts,
    read_sampling,
    read_stream,
)
from triode.frontend.openai.structured_request import read_constraint
from triode.frontend.openai.tool_request import ToolPlan, read_tools

MAX_PROMPTS = 256
MAX_CHOICES = 1024  # prompts x n in one request
CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


@attrs.frozen(kw_only=True)
class GenerationRequest:
    model: str | None
    params: SamplingParams
    stream: StreamOptions
    priority: int
    prompts: tuple[str | tuple[int, ...], ...] = ()  # completions: one engine request each
    chat: ChatOptions | None = None  # chat: a single engine request
    echo: bool = False
    # completions: echo with max_tokens 0, which scores the prompt (lm-eval's loglikelihood
    # requests, as vLLM serves them): the engine samples one token that the response leaves out
    score_only: bool = False
    logprobs: int | None = None  # completions: top-N; chat: top_logprobs when logprobs is true
    # the engine's name for a field -> the request's (response_format's parts, guided_*)
    param_names: Mapping[str, str] = attrs.field(factory=dict)
    tools: ToolPlan | None = None  # chat: how the output becomes tool_calls
    reasoning_parser: str | None = None  # chat: --reasoning-parser

    @property
    def num_requests(self) -> int:
        return 1 if self.chat is not None else len(self.prompts)


def _common(reader: Reader) -> dict[str, Any]:
    reader.string("user")
    return dict(
        model=reader.string("model"),
        stream=read_stream(reader),
        priority=reader.int("priority", 0),
    )


def parse_completion(body: dict[str, Any], defaults: GenerationDefaults | None = None) -> GenerationRequest:
    reader = Reader(body, "/v1/completions")
    common = _common(reader)
    prompts = read_prompts(reader, "prompt", limit=MAX_PROMPTS)
    reader.reject("suffix", lambda v: v == "", "is not supported")
    reader.reject("best_of", lambda v: v == 1, "is not supported (only best_of=1)")
    echo = reader.bool("echo", False)
    logprobs = reader.int("logprobs")
    max_tokens = reader.int("max_tokens", 16) if body.get("max_tokens", 16) is not None else None
    score_only = echo and max_tokens == 0
    if max_tokens == 0 and not echo:
        raise reader.fail("max_tokens", "must be at least 1, or 0 with echo to score the prompt")
    if score_only and reader.int("min_tokens", 0) > 0:
        raise reader.fail("min_tokens", "must be 0 when max_tokens is 0")
    constraint = read_constraint(reader)
    params = read_sampling(reader, max_tokens=1 if score_only else max_tokens, logprobs=logprobs,
                           prompt_logprobs=logprobs if echo else None, stream=common["stream"].stream,
                           defaults=defaults, structured_outputs=constraint.params)
    if len(prompts) * params.n > MAX_CHOICES:
        raise reader.fail("n", f"{len(prompts)} prompts x n={params.n} exceeds {MAX_CHOICES} choices")
    reader.log_unknown()
    return GenerationRequest(**common, params=params, prompts=prompts, echo=echo, score_only=score_only,
                             logprobs=logprobs, param_names=constraint.names)


@attrs.frozen(kw_only=True)
class ChatServing:
    """What the server was started with that shapes chat requests."""

    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    reasoning_parser: str | None = None


def parse_chat(body: dict[str, Any], defaults: GenerationDefaults | None = None,
               serving: ChatServing | None = None) -> GenerationRequest:
    serving = serving or ChatServing()
    reader = Reader(body, "/v1/chat/completions")
    common = _common(reader)
    chat = parse_chat_options(reader)
    tools = read_tools(reader, parser=serving.tool_call_parser, auto_enabled=serving.enable_auto_tool_choice)
    if tools is not None:
        chat = attrs.evolve(chat, tools=tools.tools)
    reader.reject("functions", lambda v: v == [], "function calling is not supported")
    reader.reject("function_call", lambda v: v == "none", "function calling is not supported")
    reader.reject("best_of", lambda v: v == 1, "is not supported (only best_of=1)")
    reader.reject("audio", lambda v: False, "audio output is not supported")
    reader.reject("modalities", lambda v: v == ["text"], "only the text modality is supported")
    logprobs = reader.bool("logprobs", False)
    top_logprobs = reader.int("top_logprobs")
    if top_logprobs is not None and not logprobs:
        raise reader.fail("top_logprobs", "requires logprobs to be true")
    max_tokens = reader.int("max_completion_tokens")
    legacy = reader.int("max_tokens")
    aliases = {"logprobs": "top_logprobs"}
    if max_tokens is not None:
        aliases["max_tokens"] = "max_completion_tokens"
    max_tokens = max_tokens if max_tokens is not None else legacy
    top = (top_logprobs or 0) if logprobs else None
    constraint = read_constraint(reader)
    forced = tools.constraint() if tools is not None else None
    if forced is not None and constraint.params is not None:
        sent = constraint.names.get("structured_outputs", "structured_outputs")
        raise bad_request(f"{sent}: cannot be combined with tool_choice {body.get('tool_choice')!r}, "
                          f"which constrains the output itself", param=sent)
    params = read_sampling(reader, max_tokens=max_tokens, logprobs=top, prompt_logprobs=None,
                           stream=common["stream"].stream, aliases=aliases, defaults=defaults,
                           structured_outputs=forced or constraint.params)
    reader.log_unknown()
    names = tools.constraint_names() if forced is not None and tools is not None else constraint.names
    return GenerationRequest(**common, params=params, chat=chat, logprobs=top,
                             param_names=names, tools=tools,
                             reasoning_parser=serving.reasoning_parser)


def parse_chat_options(reader: Reader) -> ChatOptions:
    """The messages and vLLM's template fields (``chat_template``, ``chat_template_kwargs``,
    ``add_generation_prompt``, ``continue_final_message``)."""
    messages = parse_messages(reader)
    kwargs = reader.object("chat_template_kwargs")
    return ChatOptions(
        messages=messages,
        chat_template=reader.string("chat_template"),
        chat_template_kwargs=kwargs,
        add_generation_prompt=reader.bool("add_generation_prompt", True),
        continue_final_message=reader.bool("continue_final_message", False),
    )


def parse_messages(reader: Reader) -> tuple[dict[str, Any], ...]:
    value = reader.raw("messages")
    if value is None:
        raise reader.fail("messages", "is required")
    if not isinstance(value, list):
        raise reader.fail("messages", "expected an array of messages")
    if not value:
        raise reader.fail("messages", "must contain at least one message")
    return tuple(_message(reader, index, message) for index, message in enumerate(value))


def _text(name: str, content: Any) -> str:
    try:
        return joined_text(content, name)
    except InvalidRequestError as error:
        code = "unsupported_parameter" if isinstance(error, UnsupportedContentError) else None
        raise bad_request(str(error), param=error.field, code=code) from None


def _tool_calls(name: str, calls: Any) -> list[dict[str, Any]]:
    """An assistant message's calls, their JSON-string arguments parsed (templates read them
    as objects, as Hugging Face's do)."""
    if not isinstance(calls, list):
        raise bad_request(f"{name}.tool_calls: expected an array of tool calls", param=f"{name}.tool_calls")
    parsed = []
    for index, call in enumerate(calls):
        where = f"{name}.tool_calls[{index}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise bad_request(f"{where}.function: expected an object with a name and arguments",
                              param=f"{where}.function")
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json_nesting.loads(arguments)
            except json.JSONDecodeError as error:
                raise bad_request(f"{where}.function.arguments: not valid JSON ({error.msg})",
                                  param=f"{where}.function.arguments") from None
        if not isinstance(arguments, dict):
            raise bad_request(f"{where}.function.arguments: expected a JSON object",
                              param=f"{where}.function.arguments")
        parsed.append({"id": call.get("id"), "type": "function",
                       "function": {"name": function["name"], "arguments": arguments}})
    return parsed


def _message(reader: Reader, index: int, message: Any) -> dict[str, Any]:
    name = f"messages[{index}]"
    if not isinstance(message, dict):
        raise bad_request(f"{name}: expected an object with a role and a content", param=name)
    role = message.get("role")
    if role == "function":
        raise bad_request(f"{name}.role: 'function' messages are not supported (use 'tool')",
                          param=f"{name}.role", code="unsupported_parameter")
    if role == "tool":
        call_id = message.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            raise bad_request(f"{name}.tool_call_id: a tool message needs the id of the call it answers",
                              param=f"{name}.tool_call_id")
        return {"role": "tool", "tool_call_id": call_id, "content": _text(name, message.get("content"))}
    if role not in CHAT_ROLES:
        raise bad_request(f"{name}.role: expected one of {', '.join([*CHAT_ROLES, 'tool'])}, got {role!r}",
                          param=f"{name}.role")
    content = message.get("content")
    parsed: dict[str, Any] = {"role": CHAT_ROLES[role]}
    if role == "assistant":
        if message.get("tool_calls"):
            parsed["tool_calls"] = _tool_calls(name, message["tool_calls"])
        for key in ("reasoning", "reasoning_content"):
            if isinstance(message.get(key), str):
                parsed["reasoning_content"] = message[key]  # the name chat templates read
        if content is None:
            content = ""
    parsed["content"] = _text(name, content)
    return parsed
