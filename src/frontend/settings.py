"""Server settings that are not engine arguments: API keys and the request body limit.

Read from ``TRIODE_API_KEY`` (one key, or several separated by commas) and
``TRIODE_MAX_BODY_SIZE`` (bytes, or with a unit such as ``8MiB``); ``triode serve`` flags win."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

import attrs

from engine.config import EngineArgs, parse_size
from engine.errors import InvalidRequestError
from engine.model_files.default_model import DEFAULT_MODEL_NAME

DEFAULT_MAX_BODY_BYTES = 8 << 20


def _keys(value: Sequence[str] | None) -> tuple[str, ...]:
    return tuple(k for k in (value or ()) if k)


@attrs.frozen(kw_only=True)
class ServerSettings:
    api_keys: tuple[str, ...] = attrs.field(default=(), converter=_keys)
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, *,
                 api_keys: Sequence[str] | None = None, max_body_bytes: int | None = None) -> ServerSettings:
        environ = os.environ if environ is None else environ
        if api_keys is None:
            api_keys = [k.strip() for k in environ.get("TRIODE_API_KEY", "").split(",")]
        if max_body_bytes is None:
            raw = environ.get("TRIODE_MAX_BODY_SIZE")
            try:
                max_body_bytes = parse_size(raw) if raw else DEFAULT_MAX_BODY_BYTES
            except ValueError as e:
                raise InvalidRequestError(f"TRIODE_MAX_BODY_SIZE: {e}", field="max_body_size") from None
        return cls(api_keys=api_keys, max_body_bytes=max_body_bytes)


def served_model_name(args: EngineArgs) -> str:
    """The name clients send and see: --served-model-name, else the model argument (the
    default model's own name when none is given)."""
    if args.served_model_name:
        return args.served_model_name
    return DEFAULT_MODEL_NAME if args.model in (None, "default") else args.model
