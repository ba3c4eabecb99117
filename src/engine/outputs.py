"""What the engine hands back: RequestOutput with one CompletionOutput per sample, in vLLM's
shapes, so that code written for vLLM reads them unchanged.

Logprobs are vLLM's: per generated token, a dict of token id -> ``Logprob(logprob, rank,
decoded_token)`` holding the sampled token (first) and the top-N alternatives;
``output.logprobs[i][output.token_ids[i]].logprob`` is the sampled token's. Prompt logprobs
are the same per prompt token, with None for the first (nothing predicts it).
"""

from __future__ import annotations

import attrs


@attrs.frozen
class Logprob:
    logprob: float
    rank: int | None = None  # 1 = the most likely token
    decoded_token: str | None = None  # the token on its own, decoded


SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]


@attrs.frozen(kw_only=True, eq=False)
class CompletionOutput:
    index: int
    text: str
    token_ids: tuple[int, ...]
    cumulative_logprob: float | None = None  # only when logprobs were requested
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None  # "stop", "length" or "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def followed_by(self, newer: CompletionOutput) -> CompletionOutput:
        """This delta and a newer one as a single delta (for a consumer that fell behind)."""
        logprobs = None
        if self.logprobs is not None or newer.logprobs is not None:
            logprobs = (self.logprobs or []) + (newer.logprobs or [])
        return attrs.evolve(
            newer,
            text=self.text + newer.text,
            token_ids=self.token_ids + newer.token_ids,
            logprobs=logprobs,
        )


@attrs.frozen(kw_only=True)
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@attrs.frozen(kw_only=True, eq=False)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: tuple[int, ...]
    prompt_logprobs: PromptLogprobs | None
    outputs: tuple[CompletionOutput, ...]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0

    def followed_by(self, newer: RequestOutput) -> RequestOutput:
        """Coalesces two delta outputs of one request; outputs of the same index are joined."""
        by_index = {o.index: o for o in self.outputs}
        for output in newer.outputs:
            older = by_index.get(output.index)
            by_index[output.index] = output if older is None else older.followed_by(output)
        prompt_logprobs = newer.prompt_logprobs if newer.prompt_logprobs is not None else self.prompt_logprobs
        return attrs.evolve(
            newer,
            outputs=tuple(by_index[i] for i in sorted(by_index)),
            prompt_logprobs=prompt_logprobs,
        )


@attrs.frozen(kw_only=True)
class EmbeddingOutput:
    """vLLM's ``EmbeddingOutput``: a pooling model's embedding of a prompt."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@attrs.frozen(kw_only=True, eq=False)
class EmbeddingRequestOutput:
    """vLLM's ``EmbeddingRequestOutput`` (``LLM.embed``'s items): one per prompt, final."""

    request_id: str
    prompt: str | None
    prompt_token_ids: tuple[int, ...]
    outputs: EmbeddingOutput
    metrics: RequestMetrics
    finished: bool = True
