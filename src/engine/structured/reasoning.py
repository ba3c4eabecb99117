"""``--reasoning-parser``: a reasoning model's thinking split from its answer, so that it
goes to the message's ``reasoning`` (vLLM's current name) and ``reasoning_content`` (the
earlier one, llama.cpp's), not to ``content``. Sans-IO and per choice, streamed or whole,
like the tool-call parsers; the answer part is what tool parsing then reads.

- ``deepseek_r1``: the output is thinking from its start (the chat template opened
  ``<think>``; a leading ``<think>`` is dropped too) until ``</think>``; an output that never
  closes it is all thinking, as in vLLM.
- ``qwen3``: thinking only when the output opens with ``<think>`` (with
  ``enable_thinking=False`` Qwen3's template closes the block in the prompt, and the output
  is all answer).

With a reasoning parser, a structured output constrains the answer only: its grammar is
wrapped in one that lets the thinking come first (``after_reasoning``)."""

from __future__ import annotations

import json

import attrs

from triode.engine.structured.streaming_text import held_prefix

START, END = "<think>", "</think>"


@attrs.frozen
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""


class ReasoningParser:
    name = ""
    starts_in_reasoning = True  # before any tag is seen
    # The Lark rule that lets a constrained output think first: it ends at ``@answer``.
    grammar_start = ""

    def __init__(self) -> None:
        self.reasoning = ""
        self.content = ""
        self._buffer = ""
        self._state = "start"  # start -> reasoning -> content
        self._after_end = False  # the newlines that follow </think> are layout, not answer

    def feed(self, text: str) -> list[ReasoningDelta]:
        self._buffer += text
        out: list[ReasoningDelta] = []
        if self._state == "start":
            head = self._buffer.lstrip()
            if not head or (START.startswith(head) and head != START):
                return out  # could still be the opening tag
            if head.startswith(START):
                self._buffer = head[len(START):]
                self._state = "reasoning"
            else:
                self._state = "reasoning" if self.starts_in_reasoning else "content"
        if self._state == "reasoning":
            end = self._buffer.find(END)
            if end < 0:
                keep = held_prefix(self._buffer, END)
                out.append(self._emit(reasoning=self._buffer[:len(self._buffer) - keep]))
                self._buffer = self._buffer[len(self._buffer) - keep:]
                return [d for d in out if d.reasoning or d.content]
            out.append(self._emit(reasoning=self._buffer[:end]))
            self._buffer = self._buffer[end + len(END):]
            self._state, self._after_end = "content", True
        if self._state == "content" and self._after_end:
            self._buffer = self._buffer.lstrip("\n")
            self._after_end = not self._buffer
        if self._state == "content" and self._buffer:
            out.append(self._emit(content=self._buffer))
            self._buffer = ""
        return [d for d in out if d.reasoning or d.content]

    def finish(self) -> list[ReasoningDelta]:
        rest, self._buffer = self._buffer, ""
        if not rest:
            return []
        if self._state == "reasoning" or (self._state == "start" and self.starts_in_reasoning):
            return [self._emit(reasoning=rest)]
        return [self._emit(content=rest)]

    def _emit(self, *, reasoning: str = "", content: str = "") -> ReasoningDelta:
        self.reasoning += reasoning
        self.content += content
        return ReasoningDelta(reasoning=reasoning, content=content)


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
    starts_in_reasoning = True
    grammar_start = 'start: "<think>"? thinking gap @answer'


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"
    starts_in_reasoning = False
    grammar_start = 'start: ("<think>" thinking gap)? @answer'


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    parser.name: parser for parser in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser)
}


def after_reasoning(parser: str, answer: str) -> str:
    """An llguidance grammar that lets the model reason as ``parser`` reads it, then holds
    the rest to ``answer`` (an llguidance grammar): a constraint applies to the answer only."""
    grammars = json.loads(answer)["grammars"] if answer.lstrip().startswith("{") else [{"lark_grammar": answer}]
    if len(grammars) != 1:
        raise ValueError("a constraint compiles to one grammar")
    rules = "\n".join([REASONING_PARSERS[parser].grammar_start,
                       f'thinking[lazy]: /(?s:.*)/ "{END}"', r"gap: /[\n ]*/"])
    return json.dumps({"grammars": [{"lark_grammar": rules}, {**grammars[0], "name": "answer"}]})
