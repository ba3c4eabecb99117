"""From step updates to RequestOutputs: detokenization, stop strings, logprobs, metrics.

Sans-IO: the caller passes the clock reading. A stop string is found here, after the
scheduler has already moved on, so ``process`` returns the sequences the scheduler must
finish; tokens that still arrive for them (from a step already in flight) are ignored.

The workers send logprobs compactly (``TokenLogprobs``: ids and floats); here they become
vLLM's ``{token_id: Logprob}`` dicts, each token decoded on its own once per process.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import attrs

from triode.engine.core.detokenizer import DecodeClock, IncrementalDetokenizer, TokenDecoder
from triode.engine.core.scheduler_output import SequenceUpdate
from triode.engine.outputs import (
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    Logprob,
    RequestMetrics,
    RequestOutput,
)
from triode.engine.pooling_params import PoolingParams
from triode.engine.sampling_params import OutputKind, SamplingParams


@attrs.define
class _Sample:
    seq_id: str
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = attrs.Factory(list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    sent_tokens: int = 0  # what DELTA outputs have already carried
    sent_text: int = 0
    finish_sent: bool = False
    text: str = ""


@attrs.define
class _Timeline:
    """When a request arrived, was first scheduled, and got its first and latest token."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None


@attrs.define
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    samples: list[_Sample]
    timeline: _Timeline
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    prompt_logprobs_sent: bool = False
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        for sample in self.samples:
            if sample.finish_reason is None:
                return False
        return True


@attrs.define
class _PoolingState:
    request_id: str
    prompt: str | None
    prompt_token_ids: tuple[int, ...]
    timeline: _Timeline


@attrs.frozen(kw_only=True)
class ProcessedStep:
    outputs: list[RequestOutput | EmbeddingRequestOutput]
    stop_string_finished: list[tuple[str, str]]  # (seq id, stop string): finish in the scheduler


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.decode_token = TokenDecoder(tokenizer)
        self.requests: dict[str, _RequestState] = {}
        self.pooling: dict[str, _PoolingState] = {}  # pooling requests, until their embedding
        self._request_of_seq: dict[str, str] = {}
        self._decode_clock = DecodeClock()  # the detokenizers' decoding, for statistics()

    def add_request(
        self,
        request_id: str,
        *,
        prompt: str | None,
        prompt_token_ids: Sequence[int],
        params: SamplingParams | PoolingParams,
        seq_ids: Sequence[str],
        arrival_time: float,
    ) -> None:
        if isinstance(params, PoolingParams):
            self.pooling[request_id] = _PoolingState(request_id, prompt, tuple(prompt_token_ids),
                                                     _Timeline(arrival_time))
            self._request_of_seq.update(dict.fromkeys(seq_ids, request_id))
            return
        samples = [
            _Sample(
                seq_id=seq_id,
                detokenizer=IncrementalDetokenizer(self.tokenizer, params, prompt_token_ids,
                                                   final_text_only=params.output_kind == OutputKind.FINAL_ONLY,
                                                   clock=self._decode_clock),
                logprobs=None if params.logprobs is None else [],
                cumulative_logprob=None if params.logprobs is None else 0.0,
            )
            for seq_id in seq_ids
        ]
        self.requests[request_id] = _RequestState(
            request_id=request_id,
            prompt=prompt,
            prompt_token_ids=tuple(prompt_token_ids),
            params=params,
            samples=samples,
            timeline=_Timeline(arrival_time),
            prompt_logprobs=None if params.prompt_logprobs is None else [None],
        )
        self._request_of_seq.update(dict.fromkeys(seq_ids, request_id))

    @property
    def detokenize_seconds(self) -> float:
        """Seconds the tokenizer spent decoding output text, over every request."""
        return self._decode_clock.seconds

    def mark_scheduled(self, seq_ids: Iterable[str], when: float) -> None:
        """Records when a step that runs these sequences started (the end of queueing)."""
        for seq_id in seq_ids:
            request_id = self._request_of_seq.get(seq_id, "")
            state = self.requests.get(request_id) or self.pooling.get(request_id)
            if state is not None and state.timeline.first_scheduled_time is None:
                state.timeline.first_scheduled_time = when

    def process(self, updates: Iterable[SequenceUpdate], now: float) -> ProcessedStep:
        touched: dict[str, _RequestState] = {}
        stops: list[tuple[str, str]] = []
        embedded: list[RequestOutput | EmbeddingRequestOutput] = []
        for update in updates:
            if update.embedding is not None:
                if (pooling := self.pooling.pop(update.request_id, None)) is not None:
                    embedded.append(self._embedding(pooling, update, now))
                continue
            state = self.requests.get(update.request_id)
            if state is None:
                continue  # aborted while its step ran
            sample = state.samples[update.index]
            if sample.finish_reason is not None:
                continue
            state.num_cached_tokens = max(state.num_cached_tokens, update.num_cached_tokens)
            if update.index == 0 and state.prompt_logprobs is not None:
                state.prompt_logprobs.extend(map(self.decode_token.logprobs, update.prompt_logprobs))
            if not update.new_token_ids:
                if update.finish_reason is not None:  # ended without a token: its adapter failed
                    self._end(sample, update.finish_reason)
                touched[state.request_id] = state
                continue
            self._apply_tokens(state, sample, update, now)
            # A request that wants its final output only has none to build until a sample ends
            # (LLM.generate's: most of a step's sequences, most steps).
            if sample.finish_reason is not None or state.params.output_kind != OutputKind.FINAL_ONLY:
                touched[state.request_id] = state
            if sample.detokenizer.stop_string is not None and update.finish_reason is None:
                stops.append((sample.seq_id, sample.detokenizer.stop_string))
        outputs = [out for state in touched.values() if (out := self._output(state, now)) is not None]
        return ProcessedStep(outputs=[*embedded, *outputs], stop_string_finished=stops)

    def _embedding(self, state: _PoolingState, update: SequenceUpdate, now: float) -> EmbeddingRequestOutput:
        self._request_of_seq.pop(update.seq_id, None)
        assert update.embedding is not None
        timeline = state.timeline
        return EmbeddingRequestOutput(
            request_id=state.request_id, prompt=state.prompt, prompt_token_ids=state.prompt_token_ids,
            outputs=EmbeddingOutput(embedding=list(update.embedding)),
            metrics=RequestMetrics(arrival_time=timeline.arrival_time,
                                   first_scheduled_time=timeline.first_scheduled_time,
                                   first_token_time=now, last_token_time=now, finished_time=now))

    def _apply_tokens(self, state: _RequestState, sample: _Sample, update: SequenceUpdate, now: float) -> None:
        if state.timeline.first_token_time is None:
            state.timeline.first_token_time = now
        state.timeline.last_token_time = now
        stop_token = update.finish_reason == "stop"
        detokenizer = sample.detokenizer
        before = len(detokenizer.output_token_ids)
        sample.text += detokenizer.update(
            update.new_token_ids,
            finished=update.finish_reason is not None,
            stop_terminated=stop_token,
        )
        # A stop string inside a step's tokens (speculative decoding emits several) ends the
        # output at the token that completed it: the rest are dropped.
        kept = len(detokenizer.output_token_ids) - before
        sample.token_ids.extend(update.new_token_ids[:kept])
        if sample.logprobs is not None and sample.cumulative_logprob is not None:
            for entry in update.logprobs[:kept]:
                if entry is not None:
                    sample.logprobs.append(self.decode_token.logprobs(entry))
                    sample.cumulative_logprob += entry.logprob
        if sample.detokenizer.stop_string is not None:
            sample.finish_reason, sample.stop_reason = "stop", sample.detokenizer.stop_string
        elif update.finish_reason is not None:
            sample.finish_reason, sample.stop_reason = update.finish_reason, update.stop_reason

    def forget(self, request_id: str) -> None:
        """Drops a request without an output (it failed; its stream got the error)."""
        state = self.requests.pop(request_id, None)
        for sample in state.samples if state is not None else ():
            self._request_of_seq.pop(sample.seq_id, None)
        if self.pooling.pop(request_id, None) is not None:
            self._request_of_seq.pop(request_id, None)  # its one sequence has the request's id

    def abort(self, request_id: str, now: float, reason: str = "abort") -> RequestOutput | None:
        """Ends a request that had not finished; returns its final output (None if unknown,
        or a pooling request: it has no partial result to report)."""
        if request_id in self.pooling:
            self.forget(request_id)
            return None
        state = self.requests.get(request_id)
        if state is None:
            return None
        for sample in state.samples:
            if sample.finish_reason is None:
                self._end(sample, reason)
        return self._output(state, now)

    @staticmethod
    def _end(sample: _Sample, reason: str) -> None:
        sample.text += sample.detokenizer.update((), finished=True)
        sample.finish_reason = reason

    def _output(self, state: _RequestState, now: float) -> RequestOutput | None:
        finished = state.finished
        kind = state.params.output_kind
        if not finished and kind == OutputKind.FINAL_ONLY:
            return None
        delta = kind == OutputKind.DELTA
        completions = []
        for index, sample in enumerate(state.samples):
            unchanged = sample.sent_tokens == len(sample.token_ids) and sample.sent_text == len(sample.text)
            if delta and unchanged and (sample.finish_reason is None or sample.finish_sent):
                continue  # a delta carries only samples with news: output, or their end
            start_tokens, start_text = (sample.sent_tokens, sample.sent_text) if delta else (0, 0)
            completions.append(CompletionOutput(
                index=index,
                text=sample.text[start_text:],
                token_ids=tuple(sample.token_ids[start_tokens:]),
                cumulative_logprob=sample.cumulative_logprob,
                logprobs=None if sample.logprobs is None else sample.logprobs[start_tokens:],
                finish_reason=sample.finish_reason,
                stop_reason=sample.stop_reason,
            ))
            sample.sent_tokens, sample.sent_text = len(sample.token_ids), len(sample.text)
            sample.finish_sent = sample.finish_reason is not None
        prompt_logprobs = None
        # Prompt logprobs go out once complete (a chunked prefill delivers them in parts).
        gathered = state.prompt_logprobs
        complete = gathered is not None and (len(gathered) >= len(state.prompt_token_ids) or finished)
        if gathered is not None and complete and not (delta and state.prompt_logprobs_sent):
            prompt_logprobs = list(gathered)
            state.prompt_logprobs_sent = True
        if finished:
            del self.requests[state.request_id]
            for sample in state.samples:
                self._request_of_seq.pop(sample.seq_id, None)
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            prompt_logprobs=prompt_logprobs,
            outputs=tuple(completions),
            finished=finished,
            metrics=RequestMetrics(
                arrival_time=state.timeline.arrival_time,
                first_scheduled_time=state.timeline.first_scheduled_time,
                first_token_time=state.timeline.first_token_time,
                last_token_time=state.timeline.last_token_time,
                finished_time=now if finished else None,
            ),
            num_cached_tokens=state.num_cached_tokens,
        )
