"""triode's Python API.

- ``LLM``: offline batches (sync): ``LLM().generate(prompts, SamplingParams(...))``.
- ``LLMEngine``: a sync engine whose caller drives ``step()``.
- ``AsyncLLM``: the trio API: ``async with AsyncLLM.open(EngineArgs(...)) as llm``.
"""

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
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from engine.sampling_params import OutputKind, SamplingParams

__all__ = [
    "LLM",
    "AsyncLLM",
    "CompletionOutput",
    "EngineArgs",
    "EngineDeadError",
    "EngineShutdownError",
    "EngineStatistics",
    "InvalidRequestError",
    "KVCacheTooSmallError",
    "LLMEngine",
    "ModelLoadError",
    "OutputKind",
    "QueueFull",
    "RequestMetrics",
    "RequestOutput",
    "SamplingParams",
    "TriodeError",
    "UnsupportedModelError",
]
