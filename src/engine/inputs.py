"""Request intake's sans-IO half: chat-template rendering, tokenization and validation.

Everything here is a plain function of its inputs, so the sync LLMEngine and the trio
intake actor (which runs it in a worker thread: tokenizers release the GIL) share it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
from transformers import PreTrainedTokenizerFast

from engine.errors import InvalidRequestError, ModelLoadError
from engine.sampling_params import SamplingParams

Prompt = str | Sequence[int]
ChatMessage = Mapping[str, Any]


def load_tokenizer(model_path: str | Path) -> PreTrainedTokenizerFast:
    # The fast tokenizer straight from tokenizer.json: AutoTokenizer may swap in a class
    # with a different pre-tokenizer (seen with Qwen2).
    try:
        return PreTrainedTokenizerFast.from_pretrained(str(model_path))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot load the tokenizer: {e}", path=str(model_path)) from e


@attrs.frozen(kw_only=True)
class ProcessedPrompt:
    prompt: str | None  # the text, when the request gave text or chat messages
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams  # with max_tokens bounded by the room left in max_model_len


class InputProcessor:
    def __init__(self, tokenizer: PreTrainedTokenizerFast, *, max_model_len: int, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size

    def render_chat(self, messages: Sequence[ChatMessage], *, add_generation_prompt: bool = True) -> str:
        if not messages:
            raise InvalidRequestError("messages: must contain at least one message", field="messages")
        for index, message in enumerate(messages):
            if not isinstance(message, Mapping) or "role" not in message or "content" not in message:
                raise InvalidRequestError(
                    f"messages[{index}]: each message needs a role and a content", field="messages"
                )
        if not self.tokenizer.chat_template:
            raise InvalidRequestError("this model has no chat template; send a plain prompt", field="messages")
        try:
            return self.tokenizer.apply_chat_template(
                list(messages), add_generation_prompt=add_generation_prompt, tokenize=False
            )
        except Exception as e:  # a template may raise anything for messages it rejects
            raise InvalidRequestError(f"messages: the chat template rejected them: {e}", field="messages") from e

    def process(self, prompt: Prompt, params: SamplingParams, *, chat: bool = False) -> ProcessedPrompt:
        """Tokenizes (text) or checks (token ids) the prompt and validates it with the
        parameters against the model. ``chat`` text already holds the special tokens."""
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt: must not be empty", field="prompt")
            token_ids = tuple(self.tokenizer.encode(prompt, add_special_tokens=not chat))
            text: str | None = prompt
        else:
            token_ids = tuple(prompt)
            text = None
            if not token_ids:
                raise InvalidRequestError("prompt: must not be empty", field="prompt")
            for token in token_ids:
                if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token < self.vocab_size:
                    raise InvalidRequestError(
                        f"prompt: token id {token!r} is outside the vocabulary [0, {self.vocab_size})",
                        field="prompt",
                    )
        params.validate_token_ids(self.vocab_size)
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
        return ProcessedPrompt(prompt=text, prompt_token_ids=token_ids, params=params)
