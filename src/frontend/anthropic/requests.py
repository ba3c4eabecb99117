"""A Messages API body read into the engine's terms: Anthropic's content blocks become the
chat messages Hugging Face templates read (``tool_use`` an assistant's ``tool_calls``,
``tool_result`` a ``tool`` message, ``thinking`` its ``reasoning_content``), ``tools`` and
``tool_choice`` a ``ToolPlan`` (``auto`` parsed by ``--tool-call-parser``, ``any`` and a named
``tool`` enforced by structured outputs, ``none`` text only), ``output_config.format`` (a JSON
schema) a structured-outputs constraint, ``thinking`` the template's ``enable_thinking``. A
final assistant message is a prefill the answer continues. ``temperature``, ``top_p`` and
``top_k`` are read where a client sends them (Anthropic's newest SDK no longer does), as are
vLLM's ``min_p``, ``seed``, ``repetition_penalty``, ``min_tokens`` and ``ignore_eos``;
``output_config.effort`` is accepted and has no effect.

Refused with a 400 naming the field: image and document blocks, server tools, a
``tool_result`` whose ``tool_use_id`` the previous assistant message did not call."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from triode.engine.chat_options import ChatOptions, checked_tools
from triode.engine.errors import InvalidRequestError
from triode.engine.model.generation_config import GenerationDefaults
from triode.engine.structured.params import StructuredOutputsParams
from triode.frontend.openai.errors import APIError, bad_request, from_engine_error, renamed
from triode.frontend.openai.request_body import Reader, StreamOptions, read_sampling
from triode.frontend.openai.requests import ChatServing, GenerationRequest
from triode.frontend.openai.tool_request import ToolPlan

ENDPOINT = "/v1/messages"
# Anthropic's sampling fields, and vLLM's extensions that its Messages endpoint reads too.
SAMPLING = ("temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty", "min_tokens", "ignore_eos")
_CHOICES = {"auto": "auto", "any": "required", "tool": "named", "none": "none"}
# chat's field names for a tool, as the Messages API spells them
_CHAT_TOOL_NAMES = ((".function.parameters", ".input_schema"), (".function.", "."))


def parse_messages_request(body: dict[str, Any], defaults: GenerationDefaults | None = None,
                           serving: ChatServing | None = None) -> GenerationRequest:
    serving = serving or ChatServing()
    reader = Reader(body, ENDPOINT)
    model = _model(reader)
    max_tokens = reader.int("max_tokens", minimum=1)
    if max_tokens is None:
        raise reader.fail("max_tokens", "is required")
    stream = reader.bool("stream", False)
    tools = read_tools(reader, serving)
    chat = read_chat(reader, tools, max_tokens=max_tokens)
    reader.object("metadata")
    stop = reader.raw("stop_sequences")
    if stop is not None and not (isinstance(stop, list) and all(isinstance(s, str) and s for s in stop)):
        raise reader.fail("stop_sequences", "expected an array of non-empty strings")
    try:
        forced = tools.constraint() if tools is not None else None
    except APIError as error:
        raise renamed(error, *_CHAT_TOOL_NAMES) from None
    output_format = _output_format(reader)
    if forced is not None and output_format is not None:
        raise bad_request(f"output_config.format: cannot be combined with tool_choice {body.get('tool_choice')}, "
                          f"which constrains the output itself", param="output_config.format")
    sampling = Reader({name: body.get(name) for name in SAMPLING} | {"stop": stop}, ENDPOINT)
    params = read_sampling(sampling, max_tokens=max_tokens, logprobs=None, prompt_logprobs=None,
                           stream=stream, aliases={"stop": "stop_sequences"}, defaults=defaults,
                           structured_outputs=forced or output_format)
    for name in SAMPLING:
        reader.raw(name)
    reader.log_unknown()
    return GenerationRequest(model=model, params=params, stream=StreamOptions(stream=stream, include_usage=False),
                             priority=0, chat=chat, tools=tools, reasoning_parser=serving.reasoning_parser,
                             param_names={"structured_outputs.json": "output_config.format.schema",
                                          "prompt": "messages"})


def _output_format(reader: Reader) -> StructuredOutputsParams | None:
    config = reader.object("output_config")
    if config is None or config.get("format") is None:
        return None
    value = config["format"]
    if not isinstance(value, dict) or value.get("type") != "json_schema" or not isinstance(value.get("schema"), dict):
        raise bad_request('output_config.format: expected {"type": "json_schema", "schema": {...}}',
                          param="output_config.format")
    try:
        return StructuredOutputsParams(json=value["schema"])
    except InvalidRequestError as error:
        raise from_engine_error(error, {"structured_outputs.json": "output_config.format.schema"}) from None


def _model(reader: Reader) -> str:
    model = reader.string("model")
    if not model:
        raise reader.fail("model", "is required")
    return model


def read_chat(reader: Reader, tools: ToolPlan | None, *, max_tokens: int | None = None) -> ChatOptions:
    """``system``, ``messages`` and ``thinking`` (also what count_tokens reads)."""
    messages = [*_system(reader), *_messages(reader)]
    prefill = messages[-1]["role"] == "assistant"
    kwargs = _thinking(reader, max_tokens)
    return ChatOptions(messages=messages, chat_template_kwargs=kwargs, add_generation_prompt=not prefill,
                       continue_final_message=prefill, tools=tools.tools if tools is not None else None)


def _system(reader: Reader) -> list[dict[str, Any]]:
    value = reader.raw("system")
    if value is None or value == "" or value == []:
        return []
    return [{"role": "system", "content": _texts("system", value)}]


def _texts(name: str, value: Any) -> str:
    """A string, or text blocks joined (``cache_control`` and ``citations`` are ignored)."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise bad_request(f"{name}: expected a string or an array of text blocks", param=name)
    texts = []
    for index, block in enumerate(value):
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            kind = block.get("type") if isinstance(block, dict) else None
            raise bad_request(f"{name}[{index}]: expected a text block, got type {kind!r}", param=f"{name}[{index}]")
        texts.append(block["text"])
    return "\n".join(texts)


def _messages(reader: Reader) -> list[dict[str, Any]]:
    value = reader.raw("messages")
    if not isinstance(value, list) or not value:
        raise reader.fail("messages", "expected a non-empty array of messages")
    converted: list[dict[str, Any]] = []
    called: set[str] = set()  # the tool_use ids of the last assistant message
    for index, message in enumerate(value):
        name = f"messages[{index}]"
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
            raise bad_request(f"{name}.role: expected 'user' or 'assistant'", param=f"{name}.role")
        blocks = _blocks(name, message.get("content"))
        if message["role"] == "assistant":
            assistant = _assistant(name, blocks)
            called = {call["id"] for call in assistant.get("tool_calls", ())}
            converted.append(assistant)
        else:
            converted += _user(name, blocks, called)
            called = set()
    return converted


def _blocks(name: str, content: Any) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list) or not all(isinstance(b, dict) for b in content):
        raise bad_request(f"{name}.content: expected a string or an array of content blocks",
                          param=f"{name}.content")
    return content


def _assistant(name: str, blocks: list[dict[str, Any]]) -> dict[str, Any]:
    text, reasoning, calls = [], [], []
    for index, block in enumerate(blocks):
        where, kind = f"{name}.content[{index}]", block.get("type")
        if kind == "text":
            text.append(_string(where, block, "text"))
        elif kind == "thinking":
            reasoning.append(_string(where, block, "thinking"))
        elif kind == "redacted_thinking":
            continue  # encrypted by Anthropic's servers: nothing a local model can read
        elif kind == "tool_use":
            arguments = block.get("input")
            if not isinstance(arguments, dict):
                raise bad_request(f"{where}.input: expected an object", param=f"{where}.input")
            calls.append({"id": _string(where, block, "id"), "type": "function",
                          "function": {"name": _string(where, block, "name"), "arguments": arguments}})
        else:
            raise _unsupported(where, kind, "text, thinking and tool_use")
    message: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
    if reasoning:
        message["reasoning_content"] = "".join(reasoning)
    if calls:
        message["tool_calls"] = calls
    return message


def _user(name: str, blocks: list[dict[str, Any]], called: set[str]) -> list[dict[str, Any]]:
    """Tool results first, as ``tool`` messages, then the user's text (if any)."""
    results, text = [], []
    for index, block in enumerate(blocks):
        where, kind = f"{name}.content[{index}]", block.get("type")
        if kind == "text":
            text.append(_string(where, block, "text"))
        elif kind == "tool_result":
            call_id = _string(where, block, "tool_use_id")
            if call_id not in called:
                raise bad_request(f"{where}.tool_use_id: {call_id!r} answers no tool_use block of the previous "
                                  f"assistant message", param=f"{where}.tool_use_id")
            content = block.get("content", "")
            output = _texts(f"{where}.content", content) if content is not None else ""
            if block.get("is_error") is True:
                output = f"Error: {output}"
            results.append({"role": "tool", "tool_call_id": call_id, "content": output})
        else:
            raise _unsupported(where, kind, "text and tool_result")
    return results + ([{"role": "user", "content": "\n".join(text)}] if text or not results else [])


def _string(where: str, block: Mapping[str, Any], field: str) -> str:
    value = block.get(field)
    if not isinstance(value, str):
        raise bad_request(f"{where}.{field}: expected a string", param=f"{where}.{field}")
    return value


def _unsupported(where: str, kind: Any, supported: str) -> Exception:
    return bad_request(f"{where}.type: {kind!r} blocks are not supported here (only {supported})",
                       param=f"{where}.type")


def _thinking(reader: Reader, max_tokens: int | None) -> dict[str, Any] | None:
    """Extended thinking switches the template's ``enable_thinking`` (Qwen3's and others');
    the thinking is bounded by ``max_tokens`` alone: ``budget_tokens`` is checked, not enforced."""
    value = reader.object("thinking")
    if value is None:
        return None
    kind = value.get("type")
    if kind == "disabled":
        return {"enable_thinking": False}
    if kind in ("adaptive", "between_tools"):
        return {"enable_thinking": True}
    if kind != "enabled":
        raise bad_request(f"thinking.type: expected enabled, adaptive, between_tools or disabled, got {kind!r}",
                          param="thinking.type")
    budget = value.get("budget_tokens")
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1 \
            or (max_tokens is not None and budget >= max_tokens):
        raise bad_request("thinking.budget_tokens: expected a positive integer below max_tokens",
                          param="thinking.budget_tokens")
    return {"enable_thinking": True}


def read_tools(reader: Reader, serving: ChatServing, *, check_auto: bool = True) -> ToolPlan | None:
    """``check_auto``: whether ``auto`` needs a parser (not to count tokens: nothing is parsed)."""
    raw = reader.raw("tools")
    choice = reader.object("tool_choice")
    if raw is None or raw == []:
        if choice is not None and choice.get("type") != "none":
            raise bad_request("tool_choice: needs tools", param="tool_choice")
        return None
    if not isinstance(raw, list):
        raise reader.fail("tools", "expected an array of tools")
    functions = []
    for index, tool in enumerate(raw):
        if not isinstance(tool, dict) or tool.get("type", "custom") != "custom":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise bad_request(f"tools[{index}].type: {kind!r}: only client tools (name, description, "
                              f"input_schema) are supported", param=f"tools[{index}].type")
        if "input_schema" not in tool:
            raise bad_request(f"tools[{index}].input_schema: is required", param=f"tools[{index}].input_schema")
        functions.append({"type": "function", "function": {
            "name": tool.get("name"), "description": tool.get("description"),
            "parameters": tool["input_schema"]}})
    try:
        tools = checked_tools(functions)
    except InvalidRequestError as error:
        raise renamed(from_engine_error(error), *_CHAT_TOOL_NAMES) from None
    choice = choice or {"type": "auto"}
    mode = _CHOICES.get(choice.get("type"))  # type: ignore[arg-type]
    if mode is None:
        raise bad_request(f"tool_choice.type: expected auto, any, tool or none, got {choice.get('type')!r}",
                          param="tool_choice.type")
    named = choice.get("name") if mode == "named" else None
    names = [tool["function"]["name"] for tool in tools]
    if mode == "named" and named not in names:
        raise bad_request(f"tool_choice.name: {named!r} is not one of the tools ({', '.join(names)})",
                          param="tool_choice.name")
    if mode == "auto" and check_auto and not (serving.enable_auto_tool_choice and serving.tool_call_parser):
        raise bad_request('tool_choice: "auto" needs the server to run with --enable-auto-tool-choice and '
                          '--tool-call-parser (or send {"type": "any"}, a named tool, or "none")',
                          param="tool_choice")
    parallel = not choice.get("disable_parallel_tool_use", False)
    return ToolPlan(mode=mode, tools=tools, named=named, parallel=parallel, parser=serving.tool_call_parser)


def parse_count_tokens(body: dict[str, Any], serving: ChatServing | None = None) -> tuple[str, ChatOptions]:
    """``/v1/messages/count_tokens``: the model and the chat whose prompt is counted."""
    reader = Reader(body, f"{ENDPOINT}/count_tokens")
    model = _model(reader)
    tools = read_tools(reader, serving or ChatServing(), check_auto=False)
    chat = read_chat(reader, tools)
    reader.log_unknown()
    return model, chat
