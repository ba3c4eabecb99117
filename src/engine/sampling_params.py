"""Per-request sampling parameters: one frozen, validated attrs class."""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from typing import Any, NoReturn

import attrs

from triode.engine.errors import InvalidRequestError
from triode.engine.pooling_params import check_truncation
from triode.engine.structured.params import (
    StructuredOutputsParams,  # vLLM imports it from here too
)
from triode.field_types import first_type_problem

_INT64_MIN = -(2**63)
_INT64_MAX = 2**63 - 1
MAX_LOGPROBS = 20
# Samples a request may ask for (n): each is a sequence of its own.
MAX_N = 128


class OutputKind(enum.Enum):
    CUMULATIVE = "cumulative"  # every output carries the whole text so far
    DELTA = "delta"  # every output carries only what is new
    FINAL_ONLY = "final_only"  # one output, when the request finishes


def _fail(field: str, message: str) -> NoReturn:
    raise InvalidRequestError(f"{field}: {message}", field=field)


def _stop_tuple(value: Any) -> Any:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    return tuple(value) if isinstance(value, list | tuple) else value  # anything else: refused by type


def _int_tuple(value: Any) -> Any:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list | tuple) else value


def _structured(value: StructuredOutputsParams | Mapping[str, Any] | None) -> StructuredOutputsParams | None:
    if value is None or isinstance(value, StructuredOutputsParams):
        return value
    if not isinstance(value, Mapping):
        _fail("structured_outputs", f"expected StructuredOutputsParams, got {type(value).__name__}")
    known = {field.name for field in attrs.fields(StructuredOutputsParams)}
    if unknown := sorted(set(value) - known):
        _fail("structured_outputs", f"unknown field {unknown[0]!r}; the fields are {', '.join(sorted(known))}")
    return StructuredOutputsParams(**value)


def _bias_items(value: Mapping[int, float] | tuple[tuple[int, float], ...] | None) -> tuple[tuple[int, float], ...]:
    if not value:
        return ()
    if isinstance(value, tuple) and all(isinstance(item, tuple) and len(item) == 2 for item in value):
        value = dict(value)  # the converted form, which attrs.evolve passes back in
    if not isinstance(value, Mapping):
        _fail("logit_bias", f"expected a mapping of token ids to biases, got {type(value).__name__}")
    items = []
    for token, bias in value.items():
        if isinstance(token, bool) or not isinstance(token, int | str) or (
                isinstance(token, str) and not token.lstrip("-").isdigit()):
            _fail("logit_bias", f"keys must be token ids, got {token!r}")
        if isinstance(bias, bool) or not isinstance(bias, int | float) or not math.isfinite(bias):
            _fail("logit_bias", f"the bias of token {token} must be a finite number, got {bias!r}")
        items.append((int(token), float(bias)))
    return tuple(sorted(items))


@attrs.frozen(kw_only=True)
class SamplingParams:
    """How to sample one request. Invalid values raise ``InvalidRequestError`` (a ``ValueError``)
    naming the field. Defaults follow vLLM: temperature 1.0, no truncation, 16 tokens."""

    n: int = 1
    temperature: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    top_p: float = 1.0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = attrs.field(default=(), converter=_bias_items)
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the model's max length
    min_tokens: int = 0
    stop: tuple[str, ...] = attrs.field(default=(), converter=_stop_tuple)
    stop_token_ids: tuple[int, ...] = attrs.field(default=(), converter=_int_tuple)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None  # top-N logprobs per output token, plus the chosen one
    prompt_logprobs: int | None = None
    output_kind: OutputKind = OutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = attrs.field(default=None, converter=_structured)
    # Keep the prompt's last k tokens (-1: the model's length less one, the room to generate),
    # as vLLM's truncate_prompt_tokens.
    truncate_prompt_tokens: int | None = attrs.field(default=None, validator=check_truncation)

    def __attrs_post_init__(self) -> None:
        if problem := first_type_problem(self, finite=True):
            raise InvalidRequestError(problem[1], field=problem[0])
        if not isinstance(self.output_kind, OutputKind):
            _fail("output_kind", f"expected an OutputKind, got {self.output_kind!r}")
        if not 1 <= self.n <= MAX_N:
            _fail("n", f"must be in [1, {MAX_N}], got {self.n}")
        if not self.temperature >= 0.0:
            _fail("temperature", f"must be non-negative, got {self.temperature}")
        if self.top_k < -1:
            _fail("top_k", f"must be -1, 0 (disabled) or positive, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            _fail("top_p", f"must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            _fail("min_p", f"must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                _fail(name, f"must be in [-2, 2], got {value}")
        if not self.repetition_penalty > 0.0:
            _fail("repetition_penalty", f"must be positive, got {self.repetition_penalty}")
        if self.seed is not None and not _INT64_MIN <= self.seed <= _INT64_MAX:
            _fail("seed", f"must fit in a signed 64-bit integer, got {self.seed}")
        if self.max_tokens is not None and self.max_tokens < 1:
            _fail("max_tokens", f"must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            _fail("min_tokens", f"must be non-negative, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            _fail("min_tokens", f"({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if any(not s for s in self.stop):
            _fail("stop", "stop strings must be non-empty")
        if any(t < 0 for t in self.stop_token_ids):
            _fail("stop_token_ids", "token ids must be non-negative")
        if self.structured_outputs is not None and self.ignore_eos:
            _fail("ignore_eos", "cannot be combined with structured_outputs: a constrained output "
                  "ends where its grammar does")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                _fail(name, f"must be in [0, {MAX_LOGPROBS}], got {value}")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def effective_top_k(self) -> int:
        """0 when top-k is disabled."""
        return max(self.top_k, 0)

    def validate_token_ids(self, vocab_size: int) -> None:
        """Checks the parameters that refer to token ids against the model's vocabulary."""
        for token_id, _ in self.logit_bias:
            if not 0 <= token_id < vocab_size:
                _fail("logit_bias", f"token id {token_id} is outside the vocabulary [0, {vocab_size})")
        for token_id in self.stop_token_ids:
            if token_id >= vocab_size:
                _fail("stop_token_ids", f"token id {token_id} is outside the vocabulary [0, {vocab_size})")
