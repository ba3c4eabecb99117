"""triode: a trio-native LLM inference and serving engine. This package is its Python API.

- ``LLM``: offline batches (sync): ``LLM().generate(prompts, SamplingParams(...))``, and a
  pooling model's ``LLM(model, runner="pooling").embed(prompts)``.
- ``LLMEngine``: a sync engine whose caller drives ``step()``.
- ``AsyncLLM`` (also ``AsyncLLMEngine``, vLLM's name): the trio API:
  ``async with AsyncLLM.open(EngineArgs(...)) as llm``.

The names and shapes are vLLM's (``Logprob``, ``TextPrompt``, ``TokensPrompt``...), so a vLLM
script runs with ``from vllm import`` changed to ``from triode import``. The subpackages are
``triode.engine`` (the engine core, its actors and the worker side), ``triode.frontend`` (the
OpenAI-compatible server and the ``triode`` command) and ``triode.kernels`` (attention and
linear kernels: Triton for CUDA, C and torch on a CPU).

Names are imported on first use: worker processes import ``triode.engine.worker`` modules, and a
bare GPU machine imports ``triode.kernels`` with only torch and triton installed; neither may pay
for (or pull in) trio and the actors through this package's ``__init__``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "LLM": "triode.engine.llm",
    "LLMEngine": "triode.engine.llm_engine",
    "AsyncLLM": "triode.engine.async_llm",
    "AsyncLLMEngine": "triode.engine.async_llm",
    "EngineArgs": "triode.engine.config",
    "EngineStatistics": "triode.engine.engine_stats",
    "ChatOptions": "triode.engine.chat_options",
    "CompletionOutput": "triode.engine.outputs",
    "EmbeddingOutput": "triode.engine.outputs",
    "EmbeddingRequestOutput": "triode.engine.outputs",
    "PoolingParams": "triode.engine.pooling_params",
    "LoRARequest": "triode.engine.lora.request",
    "LoRAAdapterError": "triode.engine.lora.peft_files",
    "Logprob": "triode.engine.outputs",
    "TextPrompt": "triode.engine.inputs",
    "TokensPrompt": "triode.engine.inputs",
    "RequestMetrics": "triode.engine.outputs",
    "RequestOutput": "triode.engine.outputs",
    "OutputKind": "triode.engine.sampling_params",
    "SamplingParams": "triode.engine.sampling_params",
    "StructuredOutputsParams": "triode.engine.structured.params",
    "EngineDeadError": "triode.engine.errors",
    "EngineShutdownError": "triode.engine.errors",
    "InvalidRequestError": "triode.engine.errors",
    "KVCacheTooLargeError": "triode.engine.errors",
    "KVCacheTooSmallError": "triode.engine.errors",
    "ModelLoadError": "triode.engine.errors",
    "QueueFull": "triode.engine.errors",
    "TriodeError": "triode.engine.errors",
    "UnsupportedModelError": "triode.engine.errors",
}

__all__ = [
    "LLM",
    "AsyncLLM",
    "AsyncLLMEngine",
    "ChatOptions",
    "CompletionOutput",
    "EmbeddingOutput",
    "EmbeddingRequestOutput",
    "EngineArgs",
    "EngineDeadError",
    "EngineShutdownError",
    "EngineStatistics",
    "InvalidRequestError",
    "KVCacheTooLargeError",
    "KVCacheTooSmallError",
    "LLMEngine",
    "LoRAAdapterError",
    "LoRARequest",
    "Logprob",
    "ModelLoadError",
    "OutputKind",
    "PoolingParams",
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
        raise AttributeError(f"module 'triode' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


if TYPE_CHECKING:
    from triode.engine.async_llm import AsyncLLM, AsyncLLMEngine
    from triode.engine.chat_options import ChatOptions
    from triode.engine.config import EngineArgs
    from triode.engine.engine_stats import EngineStatistics
    from triode.engine.errors import (
        EngineDeadError,
        EngineShutdownError,
        InvalidRequestError,
        KVCacheTooLargeError,
        KVCacheTooSmallError,
        ModelLoadError,
        QueueFull,
        TriodeError,
        UnsupportedModelError,
    )
    from triode.engine.inputs import TextPrompt, TokensPrompt
    from triode.engine.llm import LLM
    from triode.engine.llm_engine import LLMEngine
    from triode.engine.lora.peft_files import LoRAAdapterError
    from triode.engine.lora.request import LoRARequest
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
    from triode.engine.structured.params import StructuredOutputsParams
