"""Engine arguments: the one source of defaults for the CLI, the Python API and TRIODE_* env vars."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from triode.engine.errors import InvalidRequestError
from triode.engine.kv_events.config import KVEventsConfig, kv_events_config
from triode.engine.model.pooling import CONVERTS, RUNNERS, PoolerConfig, pooler_config
from triode.engine.spec_decode.config import SpeculativeConfig, speculative_config
from triode.field_types import first_type_problem, type_problem

DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
SCHEDULING_POLICIES = ("fcfs", "priority")
# auto, then triode.kernels.quant_linear.ACTIVATIONS (the worker resolves auto: triode.engine.worker.placement)
QUANTIZED_ACTIVATIONS = ("auto", "float32", "int8", "int16")
GiB = 1 << 30


def _typed(attribute: attrs.Attribute[Any], value: Any) -> None:
    if problem := type_problem(attribute, value):
        raise InvalidRequestError(problem, field=attribute.name)


def _positive(instance: object, attribute: attrs.Attribute[Any], value: float | None) -> None:
    _typed(attribute, value)
    if value is not None and value <= 0:
        raise InvalidRequestError(f"{attribute.name} must be positive, got {value}", field=attribute.name)


def _non_empty(instance: object, attribute: attrs.Attribute[Any], value: str) -> None:
    if not value:
        raise InvalidRequestError(f"{attribute.name} must not be empty", field=attribute.name)


def _one_of(choices: tuple[str, ...]) -> Callable[[object, attrs.Attribute[Any], str], None]:
    def check(instance: object, attribute: attrs.Attribute[Any], value: str) -> None:
        if value not in choices:
            raise InvalidRequestError(
                f"{attribute.name} must be one of {', '.join(choices)}; got {value!r}",
                field=attribute.name,
            )

    return check


_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20, "mb": 1000**2,
          "mib": 1 << 20, "g": GiB, "gb": 1000**3, "gib": GiB, "t": 1 << 40, "tb": 1000**4, "tib": 1 << 40}


def parse_size(text: str | int) -> int:
    """Bytes from ``4096``, ``512MiB``, ``2GiB``, ``1.5GB``..."""
    if isinstance(text, int) and not isinstance(text, bool):
        return text
    if not isinstance(text, str):
        raise ValueError(f"{text!r} is not a size (e.g. 4096, 512MiB, 2GiB)")
    stripped = text.strip().lower()
    number = stripped.rstrip("abcdefghijklmnopqrstuvwxyz ")
    unit = stripped[len(number):].strip()
    try:
        return int(float(number) * _UNITS[unit])
    except (KeyError, ValueError, OverflowError):  # OverflowError: 1e400, an infinite number of bytes
        raise ValueError(f"{text!r} is not a size (e.g. 4096, 512MiB, 2GiB)") from None


def _memory_size(value: str | int | None) -> int | None:
    if value is None:
        return None
    try:
        return parse_size(value)
    except ValueError as e:
        raise InvalidRequestError(f"kv_cache_memory: {e}", field="kv_cache_memory") from None


# vLLM engine arguments a ported script may pass, and what triode does instead.
_VLLM_ONLY_ARGS = {
    "trust_remote_code": "triode runs its own model implementations, never a checkpoint's code",
    "tokenizer": "the tokenizer is read from the model directory",
    "swap_space": "preempted sequences are recomputed, never swapped",
    "disable_log_stats": "statistics are kept in EngineStatistics and /metrics either way",
}


def _fraction(instance: object, attribute: attrs.Attribute[Any], value: float | None) -> None:
    _typed(attribute, value)
    if value is not None and not 0 < value <= 1:
        raise InvalidRequestError(f"{attribute.name} must be in (0, 1]; got {value!r}", field=attribute.name)


def _reasoning_parser(instance: object, attribute: attrs.Attribute[Any], value: str | None) -> None:
    from triode.engine.structured.reasoning import REASONING_PARSERS

    if value is not None and value not in REASONING_PARSERS:
        raise InvalidRequestError(f"reasoning_parser must be one of {', '.join(sorted(REASONING_PARSERS))}; "
                                  f"got {value!r}", field="reasoning_parser")


def _quantization(instance: object, attribute: attrs.Attribute[Any], value: str | None) -> None:
    from triode.engine.model_files.quantize import QUANTIZATIONS

    if value is not None and value not in QUANTIZATIONS:
        raise InvalidRequestError(f"quantization must be one of {', '.join(QUANTIZATIONS)}; got {value!r}",
                                  field="quantization")


@attrs.frozen(kw_only=True)
class EngineArgs:
    """Everything that configures one engine. Field names match vLLM's where the meaning matches."""

    model: str | None = None  # None: the default model (SmolLM2-135M-Instruct)
    served_model_name: str | None = None
    dtype: str = attrs.field(default="auto", validator=_one_of(DTYPES))
    # A float checkpoint's weights quantized at load (cached): int8 or int4, kept quantized
    # and run by the CPU kernels (triode.engine.model_files.quantize).
    quantization: str | None = attrs.field(default=None, validator=_quantization)
    # What quantized weights multiply on a CPU: float32 activations (closest to the
    # dequantized model), int8 ones per 32 values as llama.cpp does (fastest, and lossy: the
    # default model's answers change), or 15-bit integer ones (int16: interleaved weights on
    # CPUs with AVX2, logprobs within 1e-3 of float32's). auto: int16 where the CPU has those
    # kernels, float32 elsewhere (docs/benchmarks.md).
    quantized_activations: str = attrs.field(default="auto", validator=_one_of(QUANTIZED_ACTIVATIONS))
    device: str = attrs.field(default="auto", validator=_one_of(DEVICES))
    max_model_len: int | None = attrs.field(default=None, validator=_positive)
    block_size: int = attrs.field(default=16, validator=_positive)
    # None: sized from the memory left once the weights are in (worker/kv_budget.py), as
    # gpu_memory_utilization of it: of the device's memory on a GPU (0.9), of the memory
    # available on a CPU (0.5).
    kv_cache_memory: int | None = attrs.field(default=None, converter=_memory_size, validator=_positive)
    gpu_memory_utilization: float | None = attrs.field(default=None, validator=_fraction)
    max_num_seqs: int = attrs.field(default=128, validator=_positive)
    max_num_batched_tokens: int = attrs.field(default=2048, validator=_positive)
    long_prefill_token_threshold: int | None = attrs.field(default=None, validator=_positive)
    enable_prefix_caching: bool = True
    scheduling_policy: str = attrs.field(default="fcfs", validator=_one_of(SCHEDULING_POLICIES))
    tensor_parallel_size: int = attrs.field(default=1, validator=_positive)
    step_timeout: float = attrs.field(default=60.0, validator=_positive)  # seconds
    # Plan step N+1 while step N runs on the workers (vLLM's --async-scheduling). None: on
    # when the workers run on a GPU; off on a CPU, where the workers use every core and the
    # engine's work beside them gained nothing on W1 and once cost 8% (docs/benchmarks.md).
    async_scheduling: bool | None = None
    # No CUDA graphs: every decode step runs kernel by kernel (vLLM's --enforce-eager).
    enforce_eager: bool = False
    # Every kernel computes a token's result in an order that does not depend on its step's
    # batch (vLLM's VLLM_BATCH_INVARIANT): a sequence recomputed after a restart or a preemption
    # gets the bits it had. The default model's path on CPUs with AVX2 is so without it; this
    # also takes the invariant loops for quantized weights in GGUF's layout and for float
    # weights (a cost past a few rows), and refuses a device that has no invariant kernels
    # (docs/architecture.md).
    batch_invariant: bool = False
    shutdown_timeout: float = attrs.field(default=30.0, validator=_positive)
    max_queued_requests: int = attrs.field(default=1024, validator=_positive)
    seed: int = 0
    # "auto": generation_config.json's sampling defaults apply to requests that leave them
    # unset; "vllm": they do not; or a folder whose generation_config.json applies instead.
    generation_config: str = attrs.field(default="auto", validator=_non_empty)
    # How a reasoning model's <think> part is told from its answer (triode.engine.structured.reasoning): the
    # server splits it off, and structured outputs constrain only the answer.
    reasoning_parser: str | None = attrs.field(default=None, validator=_reasoning_parser)
    # Seconds a request's structured_outputs may take to compile before it is refused (400).
    structured_outputs_compile_timeout: float = attrs.field(default=5.0, validator=_positive)
    cache_dir: str | None = None  # None: $TRIODE_CACHE or the user's cache dir
    # Generation or pooling (embeddings), as vLLM's --runner / --convert: auto runs a causal
    # LM as generation and a bare decoder (Qwen3Model...) as pooling; --runner pooling on a
    # causal LM converts it (--convert embed). How a pooling model pools: --pooler-config
    # (a JSON object), else its sentence-transformers files (triode.engine.model.pooling).
    runner: str = attrs.field(default="auto", validator=_one_of(RUNNERS))
    convert: str = attrs.field(default="auto", validator=_one_of(CONVERTS))
    pooler_config: PoolerConfig | None = attrs.field(default=None, converter=pooler_config)
    # vLLM's KV-cache events (a JSON object with vLLM's KVEventsConfig fields): the prefix
    # cache's changes published on ZMQ for cache-aware routers (triode.engine.kv_events).
    kv_events_config: KVEventsConfig | None = attrs.field(default=None, converter=kv_events_config)
    # LoRA adapters chosen per request (vLLM's --enable-lora and its limits): up to max_loras
    # adapters in one step (each a slot of weights in every worker), of rank up to
    # max_lora_rank; max_cpu_loras adapters kept read in host memory (default max_loras).
    enable_lora: bool = False
    max_loras: int = attrs.field(default=1, validator=_positive)
    max_lora_rank: int = attrs.field(default=16, validator=_positive)
    max_cpu_loras: int | None = attrs.field(default=None, validator=_positive)
    # Speculative decoding (vLLM's --speculative-config, a JSON object): tokens proposed by
    # prompt lookup ("ngram") or a draft model, verified by the model in one step, the output
    # exactly the model's (triode.engine.spec_decode).
    speculative_config: SpeculativeConfig | None = attrs.field(default=None, converter=speculative_config)

    def __attrs_post_init__(self) -> None:
        if problem := first_type_problem(self):
            raise InvalidRequestError(problem[1], field=problem[0])
        if self.quantization is not None and (self.dtype != "auto" or self.device == "cuda"):
            raise InvalidRequestError(
                f"quantization {self.quantization} keeps the weights quantized for the CPU kernels: "
                f"it needs dtype auto and a CPU device (got dtype "
                f"{self.dtype}, device {self.device})", field="quantization")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise InvalidRequestError(f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras "
                                      f"({self.max_loras})", field="max_cpu_loras")

    def resolved_max_cpu_loras(self) -> int:
        return self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras

    @classmethod
    def from_options(cls, **options: Any) -> EngineArgs:
        """``EngineArgs(**options)``, where an unknown option raises ``InvalidRequestError``
        naming it (and, for a vLLM-only one, what triode does instead) rather than a
        TypeError."""
        known = {field.name for field in attrs.fields(cls)}
        for name in options:
            if name not in known:
                hint = _VLLM_ONLY_ARGS.get(name)
                detail = f"it is a vLLM argument triode does not take: {hint}" if hint else (
                    f"triode's engine arguments are {', '.join(sorted(known))}")
                raise InvalidRequestError(f"{name}: unknown engine argument; {detail}", field=name)
        return cls(**options)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> EngineArgs:
        """Reads ``TRIODE_<FIELD>`` variables (e.g. ``TRIODE_MODEL``, ``TRIODE_MAX_NUM_SEQS``)."""
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for field in attrs.fields(cls):
            raw = environ.get(f"TRIODE_{field.name.upper()}")
            if raw:  # set and empty (TRIODE_MODEL= in a unit file) is unset, not the current directory
                values[field.name] = _parse(field, raw)
        values.update(overrides)
        return cls(**values)

    def async_scheduling_on(self, worker_device: str) -> bool:
        """Whether steps are planned ahead, for workers on ``worker_device`` ("cpu", "cuda:0")."""
        if self.async_scheduling is not None:
            return self.async_scheduling
        return worker_device.startswith("cuda")

    def resolved_cache_dir(self) -> str:
        if self.cache_dir:
            return self.cache_dir
        if env := os.environ.get("TRIODE_CACHE"):
            return env
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        return os.path.join(base, "triode")


def _parse(field: attrs.Attribute[Any], raw: str) -> Any:
    kind = str(field.type)
    name = field.name
    if name == "kv_cache_memory":
        try:
            return parse_size(raw)
        except ValueError as error:  # its reason, where "not a valid int | None" gave none
            raise InvalidRequestError(f"TRIODE_KV_CACHE_MEMORY: {error}", field=name) from None
    try:
        if kind.startswith("bool"):
            lowered = raw.strip().lower()
            if lowered not in ("1", "0", "true", "false", "yes", "no", "on", "off"):
                raise ValueError(raw)
            return lowered in ("1", "true", "yes", "on")
        if kind.startswith("int"):
            return int(raw)
        if kind.startswith("float"):
            return float(raw)
    except ValueError:
        raise InvalidRequestError(
            f"TRIODE_{name.upper()}={raw!r} is not a valid {kind}", field=name
        ) from None
    return raw
