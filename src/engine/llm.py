"""LLM: offline batch generation, ``LLM(model=...).generate(prompts, sampling_params)``, and
embeddings from a pooling model, ``LLM(model=..., runner="pooling").embed(prompts)``.

The surface is vLLM's, so that a vLLM script runs with only its import changed: prompts as
text, token ids or prompt dicts, ``sampling_params=`` (one, or one per prompt), ``chat``
with its template options, ``get_tokenizer``, and outputs whose logprobs are vLLM's
list of ``{token_id: Logprob}`` dicts. It works at a script's top level, with or without an
``if __name__ == "__main__":`` guard: the worker processes never re-run the user's code.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, cast

import attrs
from tqdm import tqdm

from triode.engine.chat_options import ChatMessage, ChatOptions
from triode.engine.config import EngineArgs
from triode.engine.errors import InvalidRequestError
from triode.engine.inputs import PromptInput
from triode.engine.llm_engine import LLMEngine
from triode.engine.lora.request import LoRARequest
from triode.engine.outputs import EmbeddingRequestOutput, RequestOutput
from triode.engine.pooling_params import PoolingParams
from triode.engine.sampling_params import OutputKind, SamplingParams


class LLM:
    """``LLM(model=None, **engine_args)``: the default model when ``model`` is None. Use as a
    context manager (or call ``close``) to stop the worker processes promptly; otherwise they
    stop when the LLM is garbage-collected or the interpreter exits."""

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        self.llm_engine = LLMEngine(EngineArgs.from_options(model=model, **engine_args))
        self._next_id = 0

    def get_tokenizer(self) -> Any:
        return self.llm_engine.get_tokenizer()

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate`` and ``chat`` use without SamplingParams: vLLM's defaults under the
        model's generation_config.json ones (unless ``generation_config="vllm"``)."""
        return self.llm_engine.get_default_sampling_params()

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Outputs in input order. ``prompts``: one prompt or a list; a prompt is text, token
        ids, ``{"prompt": text}`` or ``{"prompt_token_ids": ids}``. ``lora_request``: the
        adapter of every prompt, or one per prompt (None: the base model's)."""
        batch = _as_batch(prompts)
        if priority is not None and len(priority) != len(batch):
            raise InvalidRequestError(f"priority: {len(priority)} values for {len(batch)} prompts", field="priority")
        return self._run(batch, sampling_params, use_tqdm=use_tqdm, priority=priority,
                         loras=_loras_per_prompt(lora_request, len(batch)))

    def chat(
        self,
        messages: Sequence[ChatMessage] | Sequence[Sequence[ChatMessage]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """One conversation or a list of them, rendered with the model's chat template (or
        ``chat_template``; ``chat_template_kwargs`` are the template's extra variables)."""
        conversations = cast("list[Sequence[ChatMessage]]",
                             [messages] if messages and isinstance(messages[0], Mapping) else list(messages))
        chats = [
            ChatOptions(messages=conversation, chat_template=chat_template,
                        chat_template_kwargs=chat_template_kwargs,
                        add_generation_prompt=add_generation_prompt,
                        continue_final_message=continue_final_message, tools=tools)
            for conversation in conversations
        ]
        return self._run(chats, sampling_params, use_tqdm=use_tqdm, priority=None,
                         loras=_loras_per_prompt(lora_request, len(chats)))

    def embed(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
    ) -> list[EmbeddingRequestOutput]:
        """A pooling model's embedding of each prompt, in input order (``output.outputs.embedding``).
        ``truncate_prompt_tokens``: keep each prompt's last k tokens (-1: as many as fit)."""
        batch = _as_batch(prompts)
        params = _per_prompt(pooling_params if pooling_params is not None else PoolingParams(), len(batch),
                             PoolingParams)
        if truncate_prompt_tokens is not None:
            params = [attrs.evolve(p, truncate_prompt_tokens=truncate_prompt_tokens) for p in params]
        return self._collect(batch, params, use_tqdm=use_tqdm, priority=None, kind="Embedding")

    def _run(
        self,
        prompts: Sequence[PromptInput | ChatOptions],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        *,
        use_tqdm: bool,
        priority: Sequence[int] | None,
        loras: Sequence[LoRARequest | None],
    ) -> list[RequestOutput]:
        if sampling_params is None:
            sampling_params = self.llm_engine.get_default_sampling_params()
        # Only final outputs are collected, so the engine need not build the others. One copy
        # per distinct params object: a batch shares one, and each copy validates every field.
        given = _per_prompt(sampling_params, len(prompts), SamplingParams)
        distinct = {id(p): p for p in given}
        final_only = {key: attrs.evolve(p, output_kind=OutputKind.FINAL_ONLY) for key, p in distinct.items()}
        params_list = [final_only[id(p)] for p in given]
        return self._collect(prompts, params_list, use_tqdm=use_tqdm, priority=priority, kind="Generating",
                             loras=loras)

    def _collect(self, prompts: Sequence[PromptInput | ChatOptions], params_list: Sequence[Any], *,
                 use_tqdm: bool, priority: Sequence[int] | None, kind: str,
                 loras: Sequence[LoRARequest | None] = ()) -> list[Any]:
        """Runs one request per prompt to its final output; returns them in input order."""
        engine = self.llm_engine
        ids: list[str] = []
        finished: dict[str, RequestOutput | EmbeddingRequestOutput] = {}
        # Whatever stops this call (bad input, KeyboardInterrupt, a dead engine) aborts the
        # requests it queued: the next call starts clean.
        try:
            for index, (prompt, params) in enumerate(zip(prompts, params_list, strict=True)):
                request_id = str(self._next_id)
                self._next_id += 1
                ids.append(request_id)  # first: an abort of an id that was not added is a no-op
                engine.add_request(request_id, prompt, params, priority=priority[index] if priority else 0,
                                   lora_request=loras[index] if loras else None)
            with tqdm(total=len(ids), desc=kind, unit="req", disable=not use_tqdm) as bar:
                generated = 0
                while engine.has_unfinished_requests():
                    for output in engine.step():
                        finished[output.request_id] = output
                        bar.update(1)
                        if isinstance(output, RequestOutput):
                            generated += sum(len(o.token_ids) for o in output.outputs)
                            bar.set_postfix_str(f"{generated} tokens generated", refresh=False)
        except BaseException:
            engine.abort_request([i for i in ids if i not in finished])
            raise
        return [finished[request_id] for request_id in ids]

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached prompt block: the next ``generate`` computes its prompts again,
        as a benchmark that repeats them needs. True between calls, when no request holds KV."""
        return self.llm_engine.reset_prefix_cache()

    def close(self) -> None:
        self.llm_engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _loras_per_prompt(lora_request: LoRARequest | Sequence[LoRARequest | None] | None,
                      count: int) -> list[LoRARequest | None]:
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * count
    if not isinstance(lora_request, list | tuple):
        raise InvalidRequestError(f"lora_request: expected a LoRARequest or a list of them, got "
                                  f"{type(lora_request).__name__}", field="lora_request")
    loras = list(lora_request)
    if len(loras) != count:
        raise InvalidRequestError(f"lora_request: {len(loras)} adapters for {count} prompts", field="lora_request")
    return loras


def _as_batch(prompts: PromptInput | Sequence[PromptInput]) -> list[PromptInput]:
    if isinstance(prompts, str | Mapping):
        return [prompts]
    if not isinstance(prompts, Sequence) or isinstance(prompts, bytes):
        raise InvalidRequestError(f"prompts: expected a prompt or a list of them, got {type(prompts).__name__}",
                                  field="prompt")
    items = list(prompts)
    if items and all(isinstance(t, int) for t in items):
        return [cast("list[int]", items)]  # one prompt given as token ids
    return cast("list[PromptInput]", items)


def _per_prompt(params: Any, count: int, kind: type) -> list[Any]:
    """One ``kind`` (SamplingParams or PoolingParams) for every prompt, or one per prompt."""
    if isinstance(params, kind):
        return [params] * count
    field = "sampling_params" if kind.__name__ == "SamplingParams" else "pooling_params"
    if not isinstance(params, list | tuple) or not all(isinstance(p, kind) for p in params):
        raise InvalidRequestError(f"{field}: expected {kind.__name__} or a list of them, got "
                                  f"{type(params).__name__}", field=field)
    each: list[Any] = list(params)
    if len(each) != count:
        raise InvalidRequestError(f"{field}: {len(each)} {kind.__name__} given for {count} prompts", field=field)
    return each
