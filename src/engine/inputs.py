"""Request intake's sans-IO half: prompts in vLLM's shapes, chat templates, tokenization and
validation.

Everything here is a plain function of its inputs, so the sync LLMEngine and the trio
intake actor (which runs it in a worker thread: tokenizers release the GIL) share it."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NotRequired, TypedDict, cast

import attrs
from transformers import PreTrainedTokenizerFast

from triode.engine.chat_options import (
    ChatOptions,
    joined_text,
    shipped_tool_template,
    template_reads_tools,
)
from triode.engine.errors import InvalidRequestError, ModelLoadError
from triode.engine.lora.adapters import LoRAAdapters
from triode.engine.lora.request import LoRARequest
from triode.engine.pooling_params import PoolingParams
from triode.engine.sampling_params import SamplingParams
from triode.engine.structured.compiler import GrammarCompiler


class TextPrompt(TypedDict):
    """vLLM's ``TextPrompt``: ``{"prompt": text}``."""

    prompt: str


class TokensPrompt(TypedDict):
    """vLLM's ``TokensPrompt``: ``{"prompt_token_ids": ids}``, optionally with the text they
    came from (reported as ``RequestOutput.prompt``)."""

    prompt_token_ids: list[int]
    prompt: NotRequired[str]


# vLLM's PromptType: text, token ids, or one of the two prompt dicts.
PromptInput = str | Sequence[int] | TextPrompt | TokensPrompt | Mapping[str, Any]
_PROMPT_KEYS = frozenset({"prompt", "prompt_token_ids"})
_UNSUPPORTED_PROMPT_KEYS = frozenset({"multi_modal_data", "mm_processor_kwargs", "token_type_ids",
                                      "multi_modal_uuids", "cache_salt"})


def load_tokenizer(model_path: str | Path) -> PreTrainedTokenizerFast:
    # The fast tokenizer straight from tokenizer.json: AutoTokenizer may swap in a class
    # with a different pre-tokenizer (seen with Qwen2).
    try:
        tokenizer: PreTrainedTokenizerFast = PreTrainedTokenizerFast.from_pretrained(str(model_path))
        return tokenizer
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot load the tokenizer: {e}", path=str(model_path)) from e


def parse_prompt(prompt: PromptInput) -> tuple[str | None, tuple[int, ...] | None]:
    """(text, token ids) of a prompt in any of vLLM's shapes; one of them may be None."""
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, Mapping):
        fields: Mapping[str, Any] = prompt  # a TextPrompt, a TokensPrompt, or a dict to check
        keys = set(fields)
        unsupported = sorted(keys & _UNSUPPORTED_PROMPT_KEYS)
        if unsupported:
            raise InvalidRequestError(f"prompt: {unsupported[0]!r} is not supported (text models only)",
                                      field="prompt")
        unknown = sorted(map(repr, keys - _PROMPT_KEYS))
        if unknown:
            raise InvalidRequestError(
                f"prompt: unknown key {', '.join(unknown)} in a prompt dict; it takes 'prompt' "
                f"(text) or 'prompt_token_ids'", field="prompt")
        text = fields.get("prompt")
        if text is not None and not isinstance(text, str):
            raise InvalidRequestError("prompt: 'prompt' must be a string", field="prompt")
        if "prompt_token_ids" in fields:
            ids = fields["prompt_token_ids"]
            if isinstance(ids, str | bytes) or not isinstance(ids, Sequence):
                raise InvalidRequestError("prompt: 'prompt_token_ids' must be a list of token ids",
                                          field="prompt")
            return text, tuple(ids)
        if text is None:
            raise InvalidRequestError("prompt: a prompt dict needs 'prompt' or 'prompt_token_ids'",
                                      field="prompt")
        return text, None
    if isinstance(prompt, Sequence) and not isinstance(prompt, bytes):
        return None, tuple(cast("Sequence[int]", prompt))  # checked as token ids later
    raise InvalidRequestError(
        f"prompt: expected text, token ids or a prompt dict, got {type(prompt).__name__}", field="prompt"
    )


@attrs.frozen(kw_only=True)
class ProcessedPrompt:
    prompt: str | None  # the text, when the request gave text or chat messages
    prompt_token_ids: tuple[int, ...]
    # with max_tokens bounded by the room left in max_model_len; or a pooling request's
    params: SamplingParams | PoolingParams
    lora_request: LoRARequest | None = None  # checked against the model


class InputProcessor:
    def __init__(
        self, tokenizer: PreTrainedTokenizerFast, *, max_model_len: int, vocab_size: int,
        grammars: GrammarCompiler | None = None, hidden_size: int = 0, loras: LoRAAdapters | None = None,
    ) -> None:
        """``hidden_size``: a pooling model's embedding size (what ``dimensions`` may cut);
        ``loras``: the adapter checks of an engine with LoRA enabled (None: requests may name
        no adapter)."""
        self.tokenizer = tokenizer
        self.loras = loras
        self.hidden_size = hidden_size
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.grammars = grammars

    def render_chat(self, chat: ChatOptions) -> str:
        """The chat template applied to ``chat.messages`` (``InvalidRequestError`` naming the
        field when the messages or the template do not render)."""
        if not chat.messages:
            raise InvalidRequestError("messages: must contain at least one message", field="messages")
        for index, message in enumerate(chat.messages):
            if not isinstance(message, Mapping) or "role" not in message or (
                    "content" not in message and not message.get("tool_calls")):
                raise InvalidRequestError(
                    f"messages[{index}]: each message needs a role and a content", field="messages"
                )
        if chat.chat_template is None and not self.tokenizer.chat_template:
            raise InvalidRequestError("this model has no chat template; send a plain prompt or a "
                                      "chat_template", field="messages")
        if chat.continue_final_message and chat.add_generation_prompt:
            raise InvalidRequestError("continue_final_message: cannot be combined with "
                                      "add_generation_prompt", field="continue_final_message")
        given = dict(chat.chat_template_kwargs or {})
        template, tools = chat.chat_template, dict[str, Any]()
        if chat.tools:
            tools = {"tools": [dict(tool) for tool in chat.tools]}
            if template is None and not template_reads_tools(self.tokenizer.chat_template):
                template = shipped_tool_template()
        messages = [_with_text_content(message, f"messages[{i}]") for i, message in enumerate(chat.messages)]

        def render(kwargs: dict[str, Any]) -> str:
            return cast(str, self.tokenizer.apply_chat_template(  # tokenize=False: the text
                messages, chat_template=template, add_generation_prompt=chat.add_generation_prompt,
                continue_final_message=chat.continue_final_message, tokenize=False, **kwargs))

        try:
            return render({**given, **tools})
        except Exception as e:  # a template may raise anything for input it rejects
            error = e
        field = "chat_template" if chat.chat_template is not None else "messages"
        if given:
            with contextlib.suppress(Exception):  # rendered without them: the kwargs were the cause
                render(tools)
                field = "chat_template_kwargs"
        raise InvalidRequestError(f"{field}: the chat template did not render: "
                                  f"{type(error).__name__}: {error}", field=field) from error

    def check_lora(self, lora_request: LoRARequest) -> None:
        """Raises ``LoRAAdapterError`` for an adapter the model cannot run (its files are read
        once per id), ``InvalidRequestError`` where the engine serves no adapters."""
        if self.loras is None:
            raise InvalidRequestError("lora_request: this engine serves no LoRA adapters (start it with "
                                      "enable_lora=True, --enable-lora)", field="lora_request")
        self.loras.check(lora_request)

    def process(self, prompt: PromptInput | ChatOptions, params: SamplingParams | PoolingParams,
                lora_request: LoRARequest | None = None) -> ProcessedPrompt:
        """Renders (chat), tokenizes (text) or checks (token ids) the prompt and validates it
        with the parameters (and the adapter's files) against the model. A chat's text
        already holds its special tokens, so tokenizing it adds none."""
        if lora_request is not None:
            self.check_lora(lora_request)
        if isinstance(params, PoolingParams):
            return self._pooling(prompt, params)
        text, token_ids = self._tokens(prompt, whole=params.truncate_prompt_tokens is None)
        keep = self._kept_tokens(params.truncate_prompt_tokens, output_room=1)
        if keep is not None and len(token_ids) > keep:
            token_ids = token_ids[-keep:]
            text = cast(str, self.tokenizer.decode(list(token_ids)))  # what the model reads
        params.validate_token_ids(self.vocab_size)
        if params.structured_outputs is not None:
            if self.grammars is None:
                raise InvalidRequestError("structured_outputs: this engine compiles no grammars",
                                          field="structured_outputs")
            self.grammars.check(params.structured_outputs)
        room = self.max_model_len - len(token_ids)
        if room < 1:
            raise InvalidRequestError(
                f"prompt: {len(token_ids)} tokens leave no room for output within the model's "
                f"maximum length of {self.max_model_len} tokens",
                field="prompt",
            )
        if params.max_tokens is None or params.max_tokens > room:
            if params.min_tokens > room:
                raise InvalidRequestError(
                    f"min_tokens: {params.min_tokens} exceeds the {room} tokens left after the prompt",
                    field="min_tokens",
                )
            params = attrs.evolve(params, max_tokens=room)
        return ProcessedPrompt(prompt=text, prompt_token_ids=token_ids, params=params, lora_request=lora_request)

    def _tokens(self, prompt: PromptInput | ChatOptions, *, whole: bool) -> tuple[str | None, tuple[int, ...]]:
        """The prompt's text and token ids. ``whole``: the prompt must fit the model's length
        as it is (no truncate_prompt_tokens), so a text too long for that is refused before
        it is tokenized."""
        if isinstance(prompt, ChatOptions):
            rendered = self.render_chat(prompt)
            if whole:
                self._check_fits(rendered, "messages")
            return rendered, self._in_vocabulary(self.encode(rendered, add_special_tokens=False, field="messages"),
                                                 "messages")
        text, ids = parse_prompt(prompt)
        if ids is not None:
            return text, self._checked_ids(ids)
        if not text:
            raise InvalidRequestError("prompt: must not be empty", field="prompt")
        if whole:
            self._check_fits(text, "prompt")
        return text, self._in_vocabulary(self.encode(text, add_special_tokens=True, field="prompt"), "prompt")

    def _in_vocabulary(self, token_ids: list[int], field: str) -> tuple[int, ...]:
        """The tokenizer's ids, held to the model's vocabulary: a tokenizer with tokens past the
        model's embedding (a broken checkpoint) failed the step in the worker on every retry,
        which ended the engine."""
        if token_ids and (top := max(token_ids)) >= self.vocab_size:
            raise InvalidRequestError(
                f"{field}: the model's tokenizer gives token id {top} "
                f"({self.tokenizer.convert_ids_to_tokens(top)!r}), outside the model's vocabulary "
                f"[0, {self.vocab_size})", field=field)
        return tuple(token_ids)

    @functools.cached_property
    def _longest_token_chars(self) -> int:
        return max(map(len, self.tokenizer.get_vocab()))

    def _check_fits(self, text: str, field: str) -> None:
        """Refuses a text longer than ``max_model_len`` of the vocabulary's longest tokens could
        spell, without tokenizing it: the intake takes one request at a time, and megabytes of
        text took seconds to tokenize while the requests behind it waited."""
        if len(text) > self.max_model_len and len(text) > self.max_model_len * self._longest_token_chars:
            raise InvalidRequestError(
                f"{field}: {len(text)} characters are more than the model's maximum length of "
                f"{self.max_model_len} tokens can hold (its longest token is {self._longest_token_chars} "
                f"characters)", field=field)

    def encode(self, text: str, *, add_special_tokens: bool, field: str) -> list[int]:
        """``text``'s token ids; ``InvalidRequestError`` naming ``field`` for text that is not
        valid Unicode (a lone surrogate, which JSON's \\ud800 escapes can carry and the tokenizer
        raises TypeError on)."""
        if not text.isascii():
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as e:
                raise InvalidRequestError(f"{field}: the text holds a lone surrogate "
                                          f"({text[e.start]!a}) at character {e.start}, which is not valid "
                                          f"Unicode", field=field) from None
        return cast("list[int]", self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def _pooling(self, prompt: PromptInput | ChatOptions, params: PoolingParams) -> ProcessedPrompt:
        """A prompt to embed: whole within max_model_len, or its last truncate_prompt_tokens."""
        params.validate_for(self.hidden_size)
        text, token_ids = self._tokens(prompt, whole=params.truncate_prompt_tokens is None)
        keep = self._kept_tokens(params.truncate_prompt_tokens, output_room=0)
        if keep is not None and len(token_ids) > keep:
            token_ids = self._truncated(text, token_ids, keep, from_text=not isinstance(prompt, ChatOptions))
        if len(token_ids) > self.max_model_len:
            raise InvalidRequestError(
                f"prompt: {len(token_ids)} tokens exceed the model's maximum length of {self.max_model_len} tokens "
                "(truncate_prompt_tokens keeps the last ones)", field="prompt")
        return ProcessedPrompt(prompt=text, prompt_token_ids=token_ids, params=params)

    def _kept_tokens(self, truncate_prompt_tokens: int | None, *, output_room: int) -> int | None:
        """How many of a prompt's last tokens truncate_prompt_tokens keeps (-1: as many as leave
        ``output_room`` tokens of the model's length, one to generate, none to embed); more than
        the model's length is refused."""
        if truncate_prompt_tokens is None:
            return None
        keep = self.max_model_len - output_room if truncate_prompt_tokens == -1 else truncate_prompt_tokens
        if keep > self.max_model_len:
            raise InvalidRequestError(f"truncate_prompt_tokens: {keep} exceeds the model's maximum length of "
                                      f"{self.max_model_len} tokens", field="truncate_prompt_tokens")
        return keep

    @functools.cached_property
    def _special_frame(self) -> tuple[list[int], list[int]] | None:
        """The special tokens the tokenizer puts before and after a text ([CLS], [SEP]), or
        None if they cannot be told apart from the text's own."""
        marked = self.tokenizer.encode("a", add_special_tokens=True)
        plain = self.tokenizer.encode("a", add_special_tokens=False)
        start = next((i for i in range(len(marked)) if marked[i:i + len(plain)] == plain), None)
        return None if start is None else (marked[:start], marked[start + len(plain):])

    def _truncated(self, text: str | None, token_ids: tuple[int, ...], keep: int, *,
                   from_text: bool) -> tuple[int, ...]:
        """The last ``keep`` tokens. A text prompt keeps the special tokens the tokenizer puts
        around it (an encoder's [CLS] and [SEP], which its pooling reads) and loses words."""
        frame = self._special_frame
        if text is None or not from_text or frame is None or keep <= len(frame[0]) + len(frame[1]):
            return token_ids[-keep:]
        prefix, suffix = frame
        words = self.encode(text, add_special_tokens=False, field="prompt")
        return (*prefix, *words[len(words) - (keep - len(prefix) - len(suffix)):], *suffix)

    def _checked_ids(self, token_ids: tuple[Any, ...]) -> tuple[int, ...]:
        if not token_ids:
            raise InvalidRequestError("prompt: must not be empty", field="prompt")
        for token in token_ids:
            if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token < self.vocab_size:
                raise InvalidRequestError(
                    f"prompt: token id {token!r} is outside the vocabulary [0, {self.vocab_size})",
                    field="prompt",
                )
        return token_ids


def _with_text_content(message: Mapping[str, Any], name: str) -> dict[str, Any]:
    """The message with OpenAI's array of text parts joined into one string, as templates read it."""
    if isinstance(message.get("content"), list | tuple):
        return {**message, "content": joined_text(message["content"], name)}
    return dict(message)
