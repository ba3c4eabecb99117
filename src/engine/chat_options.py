"""A chat request's options, checked where they are made: the messages, the template and its
variables, and the tools (OpenAI's function definitions) the template is given; and the
ChatML template with tools that triode ships for models whose own template ignores them.
Bad values raise ``InvalidRequestError`` naming the field, so every entry layer (``LLM.chat``,
the OpenAI, Anthropic and Responses routes) reports them the same way."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from triode.engine.errors import InvalidRequestError

ChatMessage = Mapping[str, Any]


def _checked_kwargs(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is not None and not (isinstance(value, Mapping) and all(isinstance(k, str) for k in value)):
        raise InvalidRequestError(
            f"chat_template_kwargs: expected a mapping of names to values, got {type(value).__name__}",
            field="chat_template_kwargs",
        )


def _checked_template(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is not None and not isinstance(value, str):
        raise InvalidRequestError(
            f"chat_template: expected a Jinja template string, got {type(value).__name__}",
            field="chat_template",
        )


_TOOL_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")


def _tool_error(field: str, message: str) -> InvalidRequestError:
    return InvalidRequestError(f"{field}: {message}", field=field)


def _checked_tool(index: int, tool: Any) -> dict[str, Any]:
    name = f"tools[{index}]"
    if not isinstance(tool, Mapping) or tool.get("type", "function") != "function":
        raise _tool_error(name, 'expected a function tool ({"type": "function", "function": {...}})')
    function = tool.get("function")
    if not isinstance(function, Mapping):
        raise _tool_error(f"{name}.function", "expected an object with a name")
    if not isinstance(function.get("name"), str) or not _TOOL_NAME.match(function["name"]):
        raise _tool_error(f"{name}.function.name", "expected 1 to 64 letters, digits, '_', '-', '.' or ':'")
    parameters = function.get("parameters")
    if parameters is not None and not (isinstance(parameters, Mapping) and parameters.get("type", "object") == "object"):
        raise _tool_error(f"{name}.function.parameters", "expected a JSON Schema of an object")
    if function.get("description") is not None and not isinstance(function["description"], str):
        raise _tool_error(f"{name}.function.description", "expected a string")
    if function.get("strict") is not None and not isinstance(function["strict"], bool):
        raise _tool_error(f"{name}.function.strict", "expected true or false")
    return {"type": "function", "function": dict(function)}


def checked_tools(tools: Any) -> tuple[dict[str, Any], ...]:
    """OpenAI's function definitions, checked (``InvalidRequestError`` naming the field)."""
    if isinstance(tools, str | Mapping) or not isinstance(tools, Sequence):
        raise _tool_error("tools", "expected a list of function tools")
    checked = tuple(_checked_tool(index, tool) for index, tool in enumerate(tools))
    names = [tool["function"]["name"] for tool in checked]
    if len(set(names)) != len(names):
        raise _tool_error("tools", "function names must be unique")
    return checked


def _checked_tools_or_none(tools: Any) -> tuple[dict[str, Any], ...] | None:
    return None if tools is None else checked_tools(tools)


class UnsupportedContentError(InvalidRequestError):
    """A message content part of a kind triode does not read (an image, audio...)."""


def joined_text(content: Any, name: str) -> str:
    """Message ``name``'s content as a template reads it: a string, or OpenAI's array of text
    parts joined by newlines (as vLLM joins them). Another part raises
    ``UnsupportedContentError``, anything else ``InvalidRequestError``, naming the field."""
    if isinstance(content, list | tuple):
        texts = []
        for index, part in enumerate(content):
            if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, Mapping) else None
                error = UnsupportedContentError if kind not in (None, "text") else InvalidRequestError
                raise error(f"{name}.content[{index}]: only text parts are supported (got type {kind!r})",
                            field=f"{name}.content[{index}]")
            texts.append(part["text"])
        return "\n".join(texts)
    if not isinstance(content, str):
        raise InvalidRequestError(f"{name}.content: expected a string or an array of text parts",
                                  field=f"{name}.content")
    return content


def _message_tuple(messages: Iterable[ChatMessage]) -> tuple[ChatMessage, ...]:
    return tuple(messages)


@attrs.frozen(kw_only=True, eq=False)
class ChatOptions:
    """A chat request: the messages and how to render them (vLLM's ``LLM.chat`` options). A
    ``chat_template`` replaces the model's own; ``chat_template_kwargs`` become variables of
    the template (``enable_thinking=False``, say); ``tools`` (OpenAI's function definitions)
    are passed to the template as ``tools``, as ``apply_chat_template(tools=...)`` does."""

    messages: tuple[ChatMessage, ...] = attrs.field(converter=_message_tuple)
    chat_template: str | None = attrs.field(default=None, validator=_checked_template)
    chat_template_kwargs: Mapping[str, Any] | None = attrs.field(default=None, validator=_checked_kwargs)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: tuple[Mapping[str, Any], ...] | None = attrs.field(default=None, converter=_checked_tools_or_none)


TOOL_TEMPLATE_NAME = "chatml_tools.jinja"


def shipped_tool_template() -> str:
    """triode's ChatML template with tools (Hermes ``<tool_call>`` format), for models whose
    own template ignores ``tools``."""
    return (Path(__file__).parent / "chat_templates" / TOOL_TEMPLATE_NAME).read_text()


def template_reads_tools(template: str | None) -> bool:
    return template is not None and "tools" in template
