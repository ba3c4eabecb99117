"""The closed set of messages that travel on the engine's channels (frozen attrs classes)."""

from __future__ import annotations

import attrs

from engine.core.scheduler_output import SequenceUpdate
from engine.inputs import ChatMessage, ProcessedPrompt, Prompt
from engine.sampling_params import SamplingParams


@attrs.frozen(kw_only=True)
class AddRequest:
    """A client's request, before validation and tokenization (client -> intake)."""

    request_id: str
    prompt: Prompt | None = None
    messages: tuple[ChatMessage, ...] | None = None  # chat: rendered with the template
    params: SamplingParams
    priority: int = 0
    arrival_time: float


@attrs.frozen(kw_only=True)
class NewRequest:
    """A validated, tokenized request (intake -> scheduler)."""

    request_id: str
    processed: ProcessedPrompt
    priority: int
    arrival_time: float


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
class Finished:
    """The scheduler ended these requests for a reason of its own: abort, or rejection after
    registration (scheduler -> output)."""

    request_ids: tuple[str, ...]
    reason: str = "abort"
    error: Exception | None = None


@attrs.frozen(kw_only=True)
class EngineFailed:
    """The engine is dead; every open request fails with ``error`` (scheduler -> output)."""

    error: Exception


OutputMessage = Registered | StepUpdates | Finished | EngineFailed
