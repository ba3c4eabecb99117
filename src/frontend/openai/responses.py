"""Response bodies for /v1/completions and /v1/chat/completions, whole and as stream chunks.

Choice indices are ``prompt_index * n + sample_index``. In a stream every choice gets exactly
one chunk with a finish_reason (a choice the engine ended without a last delta, which happens
on abort, gets a closing chunk with "abort"), and the usage chunk, when asked for, comes last
with empty choices; with ``continuous_usage_stats`` every chunk carries the request's usage so
far."""

from __future__ import annotations

import time
from typing import Any

from triode.engine.outputs import CompletionOutput, RequestOutput
from triode.frontend.openai.chat_output import ChatOutput, MessageDelta
from triode.frontend.openai.logprobs import CompletionLogprobs, TokenText, chat_logprobs
from triode.frontend.openai.requests import GenerationRequest


class ResponseBuilder:
    def __init__(self, request: GenerationRequest, *, response_id: str, model: str, tokenizer: Any,
                 token_text: TokenText) -> None:
        self.request = request
        self.chat = request.chat is not None
        self.id = response_id
        self.model = model
        self.created = int(time.time())
        self.tokenizer = tokenizer
        self.token_text = token_text
        self.n = request.params.n
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.cached_tokens = 0
        self._counted_prompts: set[int] = set()
        self._started: set[int] = set()  # choices that sent their first chunk
        self._finished: set[int] = set()
        self._logprobs: dict[int, CompletionLogprobs] = {}
        self._chat_outputs: dict[int, ChatOutput] = {}  # per chat choice: reasoning, tool calls

    @property
    def object(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    def _count(self, prompt_index: int, output: RequestOutput) -> None:
        if prompt_index not in self._counted_prompts:
            self._counted_prompts.add(prompt_index)
            self.prompt_tokens += len(output.prompt_token_ids)
            self.cached_tokens += output.num_cached_tokens
        if not self.request.score_only:
            self.completion_tokens += sum(len(c.token_ids) for c in output.outputs)

    def usage(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }

    def _prompt_text(self, output: RequestOutput) -> str:
        if output.prompt is not None:
            return output.prompt
        return self.tokenizer.decode(list(output.prompt_token_ids))

    def _completion_choice(self, prompt_index: int, output: RequestOutput, c: CompletionOutput) -> dict:
        index = prompt_index * self.n + c.index
        text = c.text
        logprobs = None
        first = index not in self._started
        self._started.add(index)
        formatter = self._logprobs.get(index)
        if self.request.logprobs is not None and formatter is None:
            formatter = self._logprobs[index] = CompletionLogprobs(self.token_text, self.request.logprobs)
        if first and self.request.echo:
            text = self._prompt_text(output) + ("" if self.request.score_only else text)
            if formatter is not None:
                prompt_entries = output.prompt_logprobs or [None] * len(output.prompt_token_ids)
                logprobs = formatter.format(output.prompt_token_ids, prompt_entries)
        if self.request.score_only:
            # the one token sampled after the prompt is not part of the answer: max_tokens was 0
            finished = c.finish_reason is not None
            return {"index": index, "text": text if first else "", "logprobs": logprobs,
                    "finish_reason": "length" if finished else None, "stop_reason": None}
        if formatter is not None:
            generated = formatter.format(c.token_ids, c.logprobs or ())
            logprobs = generated if logprobs is None else {k: logprobs[k] + generated[k] for k in logprobs}
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason}

    def _chat_output(self, index: int) -> ChatOutput:
        if index not in self._chat_outputs:
            self._chat_outputs[index] = ChatOutput(reasoning_parser=self.request.reasoning_parser,
                                                   tools=self.request.tools)
        return self._chat_outputs[index]

    def _chat_choice(self, prompt_index: int, c: CompletionOutput, *, stream: bool) -> dict:
        index = prompt_index * self.n + c.index
        logprobs = None
        if self.request.logprobs is not None:
            logprobs = chat_logprobs(self.token_text, c.token_ids, c.logprobs or [], self.request.logprobs)
        shaper = self._chat_output(index)
        deltas = shaper.feed(c.text)
        if c.finish_reason is not None:
            deltas += shaper.finish()
        finish_reason = shaper.finish_reason(c.finish_reason)
        if not stream:
            return {"index": index, "message": shaper.message(),
                    "logprobs": logprobs, "finish_reason": finish_reason, "stop_reason": c.stop_reason}
        delta = _joined(deltas)
        if index not in self._started:
            self._started.add(index)
            delta = {"role": "assistant", **delta}
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason,
                "stop_reason": c.stop_reason}

    def full(self, finals: list[tuple[int, RequestOutput]]) -> dict[str, Any]:
        choices = []
        for prompt_index, output in finals:
            self._count(prompt_index, output)
            for c in output.outputs:
                choices.append(self._chat_choice(prompt_index, c, stream=False) if self.chat
                               else self._completion_choice(prompt_index, output, c))
        choices.sort(key=lambda choice: choice["index"])
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "choices": choices, "usage": self.usage()}

    def chunks(self, prompt_index: int, output: RequestOutput) -> list[dict[str, Any]]:
        self._count(prompt_index, output)
        chunks = []
        for c in output.outputs:
            index = prompt_index * self.n + c.index
            if index in self._finished:
                continue
            choice = (self._chat_choice(prompt_index, c, stream=True) if self.chat
                      else self._completion_choice(prompt_index, output, c))
            if c.finish_reason is not None:
                self._finished.add(index)
            elif not self._worth_sending(choice, c):
                continue
            chunks.append(self._chunk([choice]))
        if output.finished:
            for sample in range(self.n):
                index = prompt_index * self.n + sample
                if index not in self._finished:
                    self._finished.add(index)
                    chunks.append(self._chunk([self._closing_choice(index)]))
        return chunks

    def _worth_sending(self, choice: dict[str, Any], c: CompletionOutput) -> bool:
        """A chunk with no text is sent only to open a chat choice or to carry logprobs."""
        delta = choice.get("delta", {})
        if choice.get("text") or delta.get("content") or "role" in delta or "tool_calls" in delta \
                or "reasoning" in delta:
            return True
        return self.request.logprobs is not None and bool(c.token_ids)

    def _closing_choice(self, index: int) -> dict[str, Any]:
        if self.chat:
            delta = {"content": ""} if index in self._started else {"role": "assistant", "content": ""}
            return {"index": index, "delta": delta, "logprobs": None, "finish_reason": "abort",
                    "stop_reason": None}
        return {"index": index, "text": "", "logprobs": None, "finish_reason": "abort", "stop_reason": None}

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        chunk = {"id": self.id, "object": self.object + ".chunk" if self.chat else self.object,
                 "created": self.created, "model": self.model, "choices": choices}
        if self.request.stream.include_usage:
            chunk["usage"] = self.usage() if self.request.stream.continuous_usage_stats else None
        return chunk

    def usage_chunk(self) -> dict[str, Any]:
        return {**self._chunk([]), "usage": self.usage()}


def _joined(deltas: list[MessageDelta]) -> dict[str, Any]:
    """One stream delta from what one engine output released (an empty content if nothing)."""
    joined = MessageDelta(
        reasoning="".join(d.reasoning for d in deltas), content="".join(d.content for d in deltas),
        tool_calls=tuple(call for d in deltas for call in d.tool_calls),
    ).as_delta()
    return joined or {"content": ""}
