"""triode's Python API.

- ``LLM``: offline batches (sync): ``LLM().generate(prompts, SamplingParams(...))``.
- ``LLMEngine``: a sync engine whose caller drives ``step()``.
- ``AsyncLLM``: the trio API: ``async with AsyncLLM.open(EngineArgs(...)) as llm``.

The names and shapes are vLLM's (``Logprob``, ``TextPrompt``, ``TokensPrompt``...), so a vLLM
script runs with ``from vllm import`` changed to ``from engine import``.

Names are imported on first use: worker processes import ``engine.worker`` modules, and
must not pay for (or pull in) trio and the actors through this package's ``__init__``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "LLM": "engine.llm",
    "LLMEngine": "engine.llm_engine",
    "AsyncLLM": "engine.async_llm",
    "EngineArgs": "engine.config",
    "EngineStatistics": "engine.engine_stats",
    "ChatOptions": "engine.inputs",
    "CompletionOutput": "engine.outputs",
    "Logprob": "engine.outputs",
    "TextPrompt": "engine.inputs",
    "TokensPrompt": "engine.inputs",
    "RequestMetrics": "engine.outputs",
    "RequestOutput": "engine.outputs",
    "OutputKind": "engine.sampling_params",
    "SamplingParams": "engine.sampling_params",
    "StructuredOutputsParams": "engine.structured_outputs",
    "EngineDeadError": "engine.errors",
    "EngineShutdownError": "engine.errors",
    "InvalidRequestError": "engine.errors",
    "KVCacheTooSmallError": "engine.errors",
    "ModelLoadError": "engine.errors",
    "QueueFull": "engine.errors",
    "TriodeError": "engine.errors",
    "UnsupportedModelError": "engine.errors",
}

__all__ = [
    "LLM",
    "AsyncLLM",
    "ChatOptions",
    "CompletionOutput",
    "EngineArgs",
    "EngineDeadError",
    "EngineShutdownError",
    "EngineStatistics",
    "InvalidRequestError",
    "KVCacheTooSmallError",
    "LLMEngine",
    "Logprob",
    "ModelLoadError",
    "OutputKind",
    "QueueFull",
    "RequestMetrics",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
    "TextPrompt",
    "TokensPrompt",
    "TriodeError",
    "UnsupportedModelError",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


if TYPE_CHECKING:
    from engine.async_llm import AsyncLLM
    from engine.config import EngineArgs
    from engine.engine_stats import EngineStatistics
    from engine.errors import (
        EngineDeadError,
        EngineShutdownError,
        InvalidRequestError,
        KVCacheTooSmallError,
        ModelLoadError,
        QueueFull,
        TriodeError,
        UnsupportedModelError,
    )
    from engine.inputs import ChatOptions, TextPrompt, TokensPrompt
    from engine.llm import LLM
    from engine.llm_engine import LLMEngine
    from engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
    from engine.sampling_params import OutputKind, SamplingParams
    from engine.structured_outputs import StructuredOutputsParams
