"""PoolingParams: what a pooling request (an embedding) asks of the model's pooler, as vLLM
names it. A request without them gets the model's own pooling (``PoolerConfig``)."""

from __future__ import annotations

from typing import Any

import attrs

from triode.engine.errors import InvalidRequestError


def _dimensions(instance: object, attribute: attrs.Attribute[Any], value: int | None) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise InvalidRequestError(f"dimensions: expected a positive integer, got {value!r}", field="dimensions")


def check_truncation(instance: object, attribute: attrs.Attribute[Any], value: int | None) -> None:
    """truncate_prompt_tokens, for pooling and sampling alike: None, -1 or a positive integer."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value == 0 or value < -1):
        raise InvalidRequestError(f"truncate_prompt_tokens: expected -1 or a positive integer, got {value!r}",
                                  field="truncate_prompt_tokens")


@attrs.frozen(kw_only=True)
class PoolingParams:
    # Matryoshka: the embedding's first ``dimensions`` values (normalized after the cut).
    dimensions: int | None = attrs.field(default=None, validator=_dimensions)
    # None: the model's (sentence-transformers' Normalize module, else true).
    normalize: bool | None = None
    # vLLM's truncate_prompt_tokens: keep the prompt's last k tokens (-1: as many as the model
    # takes), rather than refusing a prompt over the model's length.
    truncate_prompt_tokens: int | None = attrs.field(default=None, validator=check_truncation)

    def validate_for(self, hidden_size: int) -> None:
        if self.dimensions is not None and self.dimensions > hidden_size:
            raise InvalidRequestError(f"dimensions: {self.dimensions} exceeds the model's embedding size of "
                                      f"{hidden_size}", field="dimensions")
