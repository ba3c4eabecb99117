"""Engine options given as a JSON object (vLLM's ``--kv-events-config``, ``--pooler-config``):
one converter from the option's class itself, a mapping, or JSON text, refusing unknown
fields by name."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, TypeVar

import attrs

from triode.engine import json_nesting
from triode.engine.errors import InvalidRequestError

Options = TypeVar("Options")


def from_json_object(cls: type[Options], value: Options | Mapping[str, Any] | str | None, field: str) -> Options | None:
    if value is None or isinstance(value, cls):
        return value
    if isinstance(value, str):
        try:
            value = json_nesting.loads(value)
        except json.JSONDecodeError as error:
            raise InvalidRequestError(f"{field}: not JSON: {error}", field=field) from None
    if not isinstance(value, Mapping):
        raise InvalidRequestError(f"{field}: must be a JSON object, got {type(value).__name__}", field=field)
    known = {option.name for option in attrs.fields(cls)}  # type: ignore[arg-type]
    if unknown := sorted(set(value) - known):
        raise InvalidRequestError(f"{field}: unknown field(s) {', '.join(unknown)}; the fields are "
                                  f"{', '.join(sorted(known))}", field=field)
    return cls(**value)
