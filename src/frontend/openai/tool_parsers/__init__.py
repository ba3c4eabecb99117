"""Tool-call parsers by ``--tool-call-parser`` name (vLLM's names): each turns a model's own
tool-call markup into OpenAI's ``tool_calls``, streamed or whole (``base``)."""

from __future__ import annotations

from triode.frontend.openai.tool_parsers.base import (
    ParserDelta,
    ToolCall,
    ToolCallDelta,
    ToolCallParser,
    parse,
)
from triode.frontend.openai.tool_parsers.hermes import HermesToolParser
from triode.frontend.openai.tool_parsers.llama3_json import Llama3JsonToolParser
from triode.frontend.openai.tool_parsers.mistral import MistralToolParser

TOOL_PARSERS: dict[str, type[ToolCallParser]] = {
    parser.name: parser for parser in (HermesToolParser, Llama3JsonToolParser, MistralToolParser)
}

__all__ = ["TOOL_PARSERS", "ParserDelta", "ToolCall", "ToolCallDelta", "ToolCallParser", "parse"]
