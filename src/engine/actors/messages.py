"""The closed set of messages that travel on the engine's channels (frozen attrs classes).

A request's ``RequestStream`` travels with it (client -> intake -> scheduler -> output): it is
the request's way back to its consumer, and whoever holds the request may end it there with
an error. The output actor keeps the one table of registered requests' streams."""

from __future__ import annotations

import attrs

from triode.engine.actors.streams import RequestStream
from triode.engine.chat_options import ChatOptions
from triode.engine.core.scheduler_output import SequenceUpdate
from triode.engine.inputs import ProcessedPrompt, PromptInput
from triode.engine.lora.request import LoRARequest
from triode.engine.pooling_params import PoolingParams
from triode.engine.sampling_params import SamplingParams


@attrs.frozen(kw_only=True)
class AddRequest:
    """A client's request, before validation and tokenization (client -> intake)."""

    request_id: str
    prompt: PromptInput | None = None
    chat: ChatOptions | None = None  # a chat: its messages, rendered with the template
    params: SamplingParams | PoolingParams  # PoolingParams: an embedding
    lora_request: LoRARequest | None = None
    priority: int = 0
    arrival_time: float
    stream: RequestStream = attrs.field(eq=False)


@attrs.frozen(kw_only=True)
class NewRequest:
    """A validated, tokenized request (intake -> scheduler)."""

    request_id: str
    processed: ProcessedPrompt
    priority: int
    arrival_time: float
    stream: RequestStream = attrs.field(eq=False)


@attrs.frozen(kw_only=True)
class AbortRequests:
    """End these user requests (client -> scheduler); a final "abort" output follows for each
    that was unfinished."""

    request_ids: tuple[str, ...]


@attrs.frozen(kw_only=True)
class StopStringFound:
    """The output side found a stop string in a sequence's text (output -> scheduler): the
    sequence is finished before the next step. Its output has already ended."""

    seq_id: str
    stop_string: str


SchedulerMessage = NewRequest | AbortRequests | StopStringFound


@attrs.frozen(kw_only=True)
class Registered:
    """The scheduler accepted a request; its sequences are ``seq_ids`` (scheduler -> output).
    Sent before any step that runs them, so the output side always knows a request first."""

    request: NewRequest
    seq_ids: tuple[str, ...]


@attrs.frozen(kw_only=True)
class StepUpdates:
    """What one step did (scheduler -> output)."""

    updates: tuple[SequenceUpdate, ...]
    time: float  # when the step's result arrived
    started: float  # when the step was sent to the workers
    scheduled: tuple[str, ...] = ()  # sequences the step ran for the first time (or again)


@attrs.frozen(kw_only=True)
class Aborted:
    """The scheduler aborted these requests (scheduler -> output): each gets its final output
    with finish_reason "abort"."""

    request_ids: tuple[str, ...]
    # tokens the output side has not seen (sequences that report at their end): applied first
    unreported: tuple[SequenceUpdate, ...] = ()


@attrs.frozen(kw_only=True)
class EngineFailed:
    """The engine is dead; every open request fails with ``error`` (scheduler -> output)."""

    error: Exception


OutputMessage = Registered | StepUpdates | Aborted | EngineFailed
