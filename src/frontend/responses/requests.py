"""A Responses API body read into the engine's terms.

``input`` is text or a list of items, and so is the history a ``previous_response_id``
brings back: messages (``input_text`` / ``output_text`` parts), ``function_call`` (an
assistant's ``tool_calls``), ``function_call_output`` (a ``tool`` message, whose
``call_id`` must answer an earlier call) and ``reasoning`` (the next assistant message's
``reasoning_content``). ``instructions`` become the system message (a previous response's are
not carried over, as in OpenAI's API). ``tools`` (function tools) and ``tool_choice`` become a
``ToolPlan`` as for chat, ``text.format`` a structured-outputs constraint, ``reasoning.effort``
the template's ``reasoning_effort`` (and ``enable_thinking``: false for ``none``).

Refused with a 400 naming the field: unknown item types, images and files, other tool types,
``truncation: "auto"``, ``conversation`` and stored prompts, a ``background`` or ``stream``
combination the server does not run (below)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from triode.engine import json_nesting
from triode.engine.chat_options import ChatOptions
from triode.engine.errors import InvalidRequestError
from triode.engine.model.generation_config import GenerationDefaults
from triode.engine.sampling_params import SamplingParams
from triode.engine.structured.params import StructuredOutputsParams
from triode.frontend.openai.errors import APIError, bad_request, from_engine_error, renamed
from triode.frontend.openai.request_body import Reader, StreamOptions, read_sampling
from triode.frontend.openai.requests import ChatServing, GenerationRequest
from triode.frontend.openai.tool_request import ToolPlan, read_tools

ENDPOINT = "/v1/responses"
# The sampling fields the Responses API has, and vLLM's extensions it reads too.
SAMPLING = ("temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty", "min_tokens", "ignore_eos")
_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
_TEXT_PARTS = ("input_text", "output_text", "text", "refusal")
SCHEMA_NAME = "text.format.schema"


@attrs.frozen(kw_only=True)
class ResponsesRequest:
    model: str | None
    input_items: tuple[dict[str, Any], ...]
    instructions: str | None
    previous_response_id: str | None
    store: bool
    background: bool
    stream: bool
    params: SamplingParams
    tools: ToolPlan | None
    chat_template_kwargs: Mapping[str, Any] | None
    echo: Mapping[str, Any]  # the request's settings the response object repeats

    def generation(self, history: Sequence[dict[str, Any]], serving: ChatServing) -> GenerationRequest:
        """The engine request for this input after ``history`` (a previous response's items)."""
        messages = items_to_messages([*history, *self.input_items], first_input=len(history))
        if self.instructions:
            messages.insert(0, {"role": "system", "content": self.instructions})
        prefill = messages[-1]["role"] == "assistant" and "tool_calls" not in messages[-1]
        chat = ChatOptions(messages=messages, chat_template_kwargs=self.chat_template_kwargs,
                           add_generation_prompt=not prefill, continue_final_message=prefill,
                           tools=self.tools.tools if self.tools is not None else None)
        return GenerationRequest(model=self.model, params=self.params,
                                 stream=StreamOptions(stream=self.stream, include_usage=False), priority=0,
                                 chat=chat, tools=self.tools, reasoning_parser=serving.reasoning_parser,
                                 param_names={"structured_outputs.json": SCHEMA_NAME, "prompt": "input",
                                              "max_tokens": "max_output_tokens"})


def parse_responses_request(body: dict[str, Any], defaults: GenerationDefaults | None = None,
                            serving: ChatServing | None = None) -> ResponsesRequest:
    serving = serving or ChatServing()
    reader = Reader(body, ENDPOINT)
    model = reader.string("model")
    items = _input(reader)
    instructions = reader.string("instructions")
    previous = reader.string("previous_response_id")
    store = reader.bool("store", True)
    background = reader.bool("background", False)
    stream = reader.bool("stream", False)
    if background and not store:
        raise reader.fail("background", "needs store to be true (a background response is fetched later)")
    if background and stream:
        raise reader.fail("background", "cannot be combined with stream on this server")
    reader.reject("truncation", lambda v: v == "disabled", 'only "disabled" is supported')
    reader.reject("conversation", lambda v: False, "the Conversations API is not served (use previous_response_id)")
    reader.reject("prompt", lambda v: False, "stored prompts are not served")
    reader.reject("top_logprobs", lambda v: v == 0, "logprobs are not served here (use /v1/chat/completions)")
    for name in ("include", "safety_identifier", "prompt_cache_key", "service_tier", "max_tool_calls",
                 "stream_options"):
        reader.raw(name)  # accepted
    metadata, user = _metadata(reader), reader.string("user")  # echoed
    tools = _tools(reader, serving)
    constraint = _text_format(reader)
    try:
        forced = tools.constraint() if tools is not None else None
    except APIError as error:  # chat's field names, as the Responses API spells them
        raise renamed(error, (".function.", ".")) from None
    if forced is not None and constraint is not None:
        raise bad_request(f"text.format: cannot be combined with tool_choice {body.get('tool_choice')!r}, "
                          "which constrains the output itself", param="text.format")
    max_tokens = reader.int("max_output_tokens", minimum=1)
    sampling = Reader({name: body.get(name) for name in SAMPLING}, ENDPOINT)
    # A background response reads deltas too: it is accepted at its first token, not its last.
    params = read_sampling(sampling, max_tokens=max_tokens, logprobs=None, prompt_logprobs=None,
                           stream=stream or background,
                           aliases={"max_tokens": "max_output_tokens"}, defaults=defaults,
                           structured_outputs=forced or constraint)
    for name in SAMPLING:
        reader.raw(name)
    effort = _reasoning(reader)
    reader.log_unknown()
    echo = {"instructions": instructions, "max_output_tokens": max_tokens, "metadata": metadata,
            "parallel_tool_calls": body.get("parallel_tool_calls", True), "previous_response_id": previous,
            "reasoning": {"effort": effort, "summary": None}, "store": store, "background": background,
            "temperature": params.temperature, "top_p": params.top_p, "truncation": "disabled",
            "text": {"format": (body.get("text") or {}).get("format") or {"type": "text"}},
            "tool_choice": body.get("tool_choice") or ("auto" if tools is not None else "none"),
            "tools": body.get("tools") or [], "user": user}
    kwargs = None if effort is None else {"reasoning_effort": effort, "enable_thinking": effort != "none"}
    return ResponsesRequest(model=model, input_items=items, instructions=instructions, previous_response_id=previous,
                            store=store, background=background, stream=stream, params=params,
                            tools=tools, chat_template_kwargs=kwargs, echo=echo)


def _input(reader: Reader) -> tuple[dict[str, Any], ...]:
    value = reader.raw("input")
    if isinstance(value, str):
        return ({"type": "message", "role": "user", "content": value},)
    if not isinstance(value, list) or not value:
        raise reader.fail("input", "expected a string or a non-empty array of items")
    for index, item in enumerate(value):
        if not isinstance(item, dict):
            raise reader.fail(f"input[{index}]", "expected an item object")
    return tuple(value)


def items_to_messages(items: Sequence[dict[str, Any]], *, first_input: int = 0) -> list[dict[str, Any]]:
    """Responses items as chat-template messages. Items before ``first_input`` came from the
    store; errors name the others by their place in ``input``."""
    messages: list[dict[str, Any]] = []
    calls: set[str] = set()
    reasoning = ""
    for position, item in enumerate(items):
        where = f"input[{position - first_input}]" if position >= first_input else "previous_response_id"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise bad_request(f"{where}.role: expected user, assistant, system or developer, got {role!r}",
                                  param=f"{where}.role")
            message = {"role": "system" if role == "developer" else role, "content": _text(where, item)}
            if role == "assistant":
                _assistant(messages, reasoning, content=message["content"])
                reasoning = ""
            else:
                messages.append(message)
        elif kind == "function_call":
            call = {"id": _string(where, item, "call_id"), "type": "function",
                    "function": {"name": _string(where, item, "name"), "arguments": _arguments(where, item)}}
            calls.add(call["id"])
            _assistant(messages, reasoning, call=call)
            reasoning = ""
        elif kind == "function_call_output":
            call_id = _string(where, item, "call_id")
            if call_id not in calls:
                raise bad_request(f"{where}.call_id: no function_call with call_id {call_id!r} comes before it",
                                  param=f"{where}.call_id")
            text = _text(where, item, field="output")
            messages.append({"role": "tool", "tool_call_id": call_id, "content": text})
        elif kind == "reasoning":
            reasoning += _reasoning_text(where, item)
        else:
            raise bad_request(f"{where}.type: unknown or unsupported item type {kind!r} (supported: message, "
                              "function_call, function_call_output, reasoning)", param=f"{where}.type")
    if not messages:
        raise bad_request("input: holds no message", param="input")
    return messages


def _reasoning_text(where: str, item: Mapping[str, Any]) -> str:
    """A reasoning item's ``reasoning_text`` parts (its summary is not the reasoning)."""
    content = item.get("content") or []
    if not isinstance(content, list):
        raise bad_request(f"{where}.content: expected an array of reasoning_text parts", param=f"{where}.content")
    for index, part in enumerate(content):
        if not isinstance(part, dict) or not isinstance(part.get("text"), str):
            raise bad_request(f"{where}.content[{index}].text: expected a string", param=f"{where}.content[{index}].text")
    return "".join(part["text"] for part in content)


def _assistant(messages: list[dict[str, Any]], reasoning: str, *, content: str = "",
               call: dict[str, Any] | None = None) -> None:
    """An assistant turn: consecutive calls (and text) join one message, as templates expect."""
    last = messages[-1] if messages else None
    if last is None or last["role"] != "assistant" or (call is None and "tool_calls" in last):
        last = {"role": "assistant", "content": ""}
        messages.append(last)
    last["content"] += content
    if reasoning:
        last["reasoning_content"] = last.get("reasoning_content", "") + reasoning
    if call is not None:
        last.setdefault("tool_calls", []).append(call)


def _text(where: str, item: Mapping[str, Any], field: str = "content") -> str:
    content = item.get(field)
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where}.{field}: expected a string or an array of text parts", param=f"{where}.{field}")
    texts = []
    for index, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        text = part.get("text", part.get("refusal")) if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS or not isinstance(text, str):
            raise bad_request(f"{where}.{field}[{index}].type: only text parts are supported (got {kind!r})",
                              param=f"{where}.{field}[{index}].type")
        texts.append(text)
    return "".join(texts)


def _string(where: str, item: Mapping[str, Any], field: str) -> str:
    value = item.get(field)
    if not isinstance(value, str) or not value:
        raise bad_request(f"{where}.{field}: expected a non-empty string", param=f"{where}.{field}")
    return value


def _arguments(where: str, item: Mapping[str, Any]) -> dict[str, Any]:
    try:
        value = json_nesting.loads(_string(where, item, "arguments"))
    except json.JSONDecodeError as error:
        raise bad_request(f"{where}.arguments: not valid JSON ({error.msg})", param=f"{where}.arguments") from None
    if not isinstance(value, dict):
        raise bad_request(f"{where}.arguments: expected a JSON object", param=f"{where}.arguments")
    return value


def _tools(reader: Reader, serving: ChatServing) -> ToolPlan | None:
    """Function tools, flat as the Responses API has them, read as chat's are."""
    raw, choice = reader.raw("tools"), reader.raw("tool_choice")
    if raw is not None and not isinstance(raw, list):
        raise reader.fail("tools", "expected an array of function tools")
    functions = []
    for index, tool in enumerate(raw or ()):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise bad_request(f"tools[{index}].type: only function tools are supported (got {kind!r})",
                              param=f"tools[{index}].type")
        functions.append({"type": "function", "function": {
            key: tool[key] for key in ("name", "description", "parameters") if tool.get(key) is not None}})
    if isinstance(choice, dict):
        if choice.get("type") != "function":
            raise bad_request(f"tool_choice.type: only a function can be chosen (got {choice.get('type')!r})",
                              param="tool_choice.type")
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    chat_body = {"tools": functions, "tool_choice": choice, "parallel_tool_calls": reader.raw("parallel_tool_calls")}
    try:
        return read_tools(Reader(chat_body, ENDPOINT), parser=serving.tool_call_parser,
                          auto_enabled=serving.enable_auto_tool_choice)
    except APIError as error:  # chat's field names, as the Responses API spells them
        raise renamed(error, (".function.", ".")) from None


def _text_format(reader: Reader) -> StructuredOutputsParams | None:
    text = reader.object("text")
    value = (text or {}).get("format")
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind != "json_schema" or not isinstance(value.get("schema"), dict):
        raise bad_request('text.format: expected {"type": "text"}, {"type": "json_object"} or '
                          '{"type": "json_schema", "name": ..., "schema": {...}}', param="text.format")
    if not isinstance(value.get("name"), str) or not value["name"]:
        raise bad_request("text.format.name: is required (a non-empty string)", param="text.format.name")
    try:
        return StructuredOutputsParams(json=value["schema"])
    except InvalidRequestError as error:
        raise from_engine_error(error, {"structured_outputs.json": SCHEMA_NAME}) from None


def _reasoning(reader: Reader) -> str | None:
    value = reader.object("reasoning")
    effort = (value or {}).get("effort")
    if effort is not None and effort not in _EFFORTS:
        raise bad_request(f"reasoning.effort: expected one of {', '.join(_EFFORTS)}, got {effort!r}",
                          param="reasoning.effort")
    return effort


def _metadata(reader: Reader) -> dict[str, str]:
    """OpenAI's metadata: up to 16 pairs of strings, keys up to 64 characters, values up to 512."""
    metadata = reader.object("metadata") or {}
    if len(metadata) > 16:
        raise reader.fail("metadata", f"holds at most 16 pairs, got {len(metadata)}")
    for key, value in metadata.items():
        if len(key) > 64 or not isinstance(value, str) or len(value) > 512:
            raise reader.fail("metadata", f"{key[:64]!r}: keys are strings of up to 64 characters and values "
                                          f"strings of up to 512")
    return metadata
