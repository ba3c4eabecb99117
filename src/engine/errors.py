"""Typed errors of the public API: every failure a user can cause has its own class."""

from __future__ import annotations


class TriodeError(Exception):
    """Base class of every error triode raises on purpose."""


class ModelLoadError(TriodeError):
    """A model could not be resolved or loaded; the message names the file and the problem."""

    def __init__(self, message: str, *, path: str | None = None) -> None:
        super().__init__(f"{path}: {message}" if path else message)
        self.path = path


class UnsupportedModelError(ModelLoadError):
    """The model's architecture is not one triode implements."""


class KVCacheTooSmallError(ModelLoadError):
    """The KV-cache budget cannot hold even one sequence of the model's maximum length."""


class KVCacheTooLargeError(ModelLoadError):
    """The KV-cache budget given is more than the memory the machine (or the device) has."""


class InvalidRequestError(TriodeError, ValueError):
    """A request or one of its parameters is invalid; ``field`` names the culprit."""

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class QueueFull(TriodeError):
    """The engine's intake queue is full; retry later (HTTP 503 with Retry-After)."""


class EngineDeadError(TriodeError):
    """The engine failed (e.g. its workers exceeded the restart budget); ``__cause__`` says why.
    Every open request gets it and new requests are refused."""


class EngineShutdownError(TriodeError):
    """The engine is shutting down or closed and accepts no new requests."""


class WorkerFailure(TriodeError):
    """One worker step failed (crash, hang or exception); the worker group was restarted and
    the running requests must be recomputed."""


class StepTimeout(WorkerFailure):
    """A worker step ran past ``step_timeout``."""
