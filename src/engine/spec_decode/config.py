"""``--speculative-config``: vLLM's SpeculativeConfig fields, for the methods triode runs.

``{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max":
5}`` proposes the tokens that followed the latest earlier occurrence of the text's last n-gram
(prompt lookup); ``{"model": DIR, "num_speculative_tokens": 4}`` a draft model's greedy tokens
(any model triode serves with the target's tokenizer). Proposals are verified by the target
model in one step and kept exactly as it would have sampled them (docs/serving.md,
"Speculative decoding")."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from triode.engine.errors import InvalidRequestError
from triode.engine.json_options import from_json_object

METHODS = ("ngram", "draft_model")
# Methods vLLM has that need trained heads (EAGLE, Medusa, MTP...): named so that a ported
# config is refused for what it is, not as a typo.
_NOT_BUILT = ("eagle", "eagle3", "medusa", "mlp_speculator", "mtp", "deepseek_mtp", "suffix")
MAX_SPECULATIVE_TOKENS = 16
_FIELD = "speculative_config"


def _error(name: str, message: str) -> InvalidRequestError:
    return InvalidRequestError(f"{_FIELD}.{name}: {message}", field=_FIELD)


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


@attrs.frozen(kw_only=True)
class SpeculativeConfig:
    """How a step's tokens are proposed for verification. ``method`` None means "draft_model"
    when ``model`` is given (vLLM's rule); ``"[ngram]"`` is vLLM's older spelling of "ngram".
    ``prompt_lookup_min`` / ``max`` default to each other, or both to 5 (vLLM's defaults).
    ``disable_by_batch_size``: no sequence speculates while more than this many run (None:
    the device's default, where verifying stops paying: ``resolved_disable_by_batch_size``)."""

    method: str | None = None
    num_speculative_tokens: int | None = None
    model: str | None = None
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    disable_by_batch_size: int | None = None

    def __attrs_post_init__(self) -> None:
        method = self.method
        if method == "[ngram]":
            method = "ngram"
        if method is None:
            if self.model is None:
                raise _error("method", f"give a method ({', '.join(METHODS)}) or a draft model")
            method = "draft_model"
        if method in _NOT_BUILT:
            raise _error("method", f"{method!r} needs a trained speculator head, which triode does not run "
                                   f"yet; the methods are {', '.join(METHODS)}")
        if method not in METHODS:
            raise _error("method", f"must be one of {', '.join(METHODS)}; got {method!r}")
        object.__setattr__(self, "method", method)
        if self.num_speculative_tokens is None:
            raise _error("num_speculative_tokens", "is required (the tokens proposed per step)")
        if not _positive_int(self.num_speculative_tokens) or self.num_speculative_tokens > MAX_SPECULATIVE_TOKENS:
            raise _error("num_speculative_tokens", f"must be an integer from 1 to {MAX_SPECULATIVE_TOKENS}, "
                                                   f"got {self.num_speculative_tokens!r}")
        if method == "draft_model":
            if not isinstance(self.model, str) or not self.model:
                raise _error("model", "the draft model's directory, .gguf file or hub id is required")
            if self.prompt_lookup_min is not None or self.prompt_lookup_max is not None:
                raise _error("prompt_lookup_min", "applies to method ngram only")
        else:
            if self.model is not None:
                raise _error("model", "method ngram proposes from the text itself and takes no model")
            low, high = self.prompt_lookup_min, self.prompt_lookup_max
            low, high = (5, 5) if low is None and high is None else (low or high, high or low)
            for name, value in (("prompt_lookup_min", low), ("prompt_lookup_max", high)):
                if not _positive_int(value):
                    raise _error(name, f"must be a positive integer, got {value!r}")
            assert low is not None and high is not None  # both checked just above
            if low > high:
                raise _error("prompt_lookup_min", f"({low}) must not exceed prompt_lookup_max ({high})")
            object.__setattr__(self, "prompt_lookup_min", low)
            object.__setattr__(self, "prompt_lookup_max", high)
        if self.disable_by_batch_size is not None and not _positive_int(self.disable_by_batch_size):
            raise _error("disable_by_batch_size", f"must be a positive integer, got {self.disable_by_batch_size!r}")

    def resolved_disable_by_batch_size(self, worker_device: str) -> int:
        """Sequences running at most for speculation to go on: the config's, else where a step
        of the verified rows stops being cheaper per token than plain decoding (measured in
        docs/benchmarks.md, "Speculative decoding")."""
        if self.disable_by_batch_size is not None:
            return self.disable_by_batch_size
        return 32 if worker_device.startswith("cuda") else 4


def speculative_config(value: SpeculativeConfig | Mapping[str, Any] | str | None) -> SpeculativeConfig | None:
    """EngineArgs' converter: a SpeculativeConfig from itself, a mapping or vLLM's JSON text."""
    return from_json_object(SpeculativeConfig, value, _FIELD)
