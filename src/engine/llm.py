"""LLM: offline batch generation, `LLM(model=...).generate(prompts, params)`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs
from tqdm import tqdm

from engine.config import EngineArgs
from engine.inputs import ChatMessage, Prompt
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.sampling_params import OutputKind, SamplingParams


class LLM:
    """``LLM(model=None, **engine_args)``: the default model when ``model`` is None. Use as a
    context manager (or call ``close``) to stop the worker processes promptly."""

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        self.engine = LLMEngine(EngineArgs(model=model, **engine_args))
        self._next_id = 0

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Outputs in input order. ``prompts``: a string, token ids, or a list of either."""
        batch = _as_batch(prompts)
        return self._run(batch, params, use_tqdm=use_tqdm, priority=priority, chat=False)

    def chat(
        self,
        messages: Sequence[ChatMessage] | Sequence[Sequence[ChatMessage]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """One conversation or a list of them, rendered with the model's chat template."""
        conversations = [messages] if messages and isinstance(messages[0], Mapping) else list(messages)
        prompts = [self.engine.inputs.render_chat(c) for c in conversations]
        return self._run(prompts, params, use_tqdm=use_tqdm, priority=None, chat=True)

    def _run(self, prompts, params, *, use_tqdm: bool, priority, chat: bool) -> list[RequestOutput]:
        # Only final outputs are collected, so the engine need not build the others.
        params_list = [
            attrs.evolve(p, output_kind=OutputKind.FINAL_ONLY) for p in _per_prompt(params, len(prompts))
        ]
        ids = []
        for index, (prompt, request_params) in enumerate(zip(prompts, params_list, strict=True)):
            request_id = str(self._next_id)
            self._next_id += 1
            try:
                self.engine.add_request(
                    request_id, prompt, request_params,
                    priority=priority[index] if priority else 0, chat=chat,
                )
            except BaseException:
                self.engine.abort_request(ids)  # the batch fails whole, leaving nothing queued
                raise
            ids.append(request_id)
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="Generating", unit="req", disable=not use_tqdm) as bar:
            generated = 0
            while self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    finished[output.request_id] = output
                    generated += sum(len(o.token_ids) for o in output.outputs)
                    bar.update(1)
                    bar.set_postfix_str(f"{generated} tokens generated", refresh=False)
        return [finished[request_id] for request_id in ids]

    def close(self) -> None:
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _as_batch(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    items = list(prompts)
    if items and all(isinstance(t, int) for t in items):
        return [items]  # one prompt given as token ids
    return items


def _per_prompt(params, count: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * count
    if isinstance(params, SamplingParams):
        return [params] * count
    params = list(params)
    if len(params) != count:
        raise ValueError(f"params: {len(params)} SamplingParams for {count} prompts")
    return params
