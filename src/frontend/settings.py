"""Server settings that are not engine arguments: API keys, the request body limit, and whether
requests may bring their own chat template.

Read from ``TRIODE_API_KEY`` (one key, or several separated by commas),
``TRIODE_MAX_BODY_SIZE`` (bytes, or with a unit such as ``8MiB``) and
``TRIODE_TRUST_REQUEST_CHAT_TEMPLATE``; ``triode serve`` flags win.

A chat template is a Jinja program: rendered in a sandbox, it still runs for as long as its
loops say, in the intake thread every request shares. So, as vLLM does, a request's
``chat_template`` is refused unless the server trusts its clients
(``--trust-request-chat-template``); ``chat_template_kwargs`` (plain variables) are always
taken."""

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
    trust_request_chat_template: bool = False

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, *,
                 api_keys: Sequence[str] | None = None, max_body_bytes: int | None = None,
                 trust_request_chat_template: bool | None = None) -> ServerSettings:
        environ = os.environ if environ is None else environ
        if api_keys is None:
            api_keys = [k.strip() for k in environ.get("TRIODE_API_KEY", "").split(",")]
        if max_body_bytes is None:
            raw = environ.get("TRIODE_MAX_BODY_SIZE")
            try:
                max_body_bytes = parse_size(raw) if raw else DEFAULT_MAX_BODY_BYTES
            except ValueError as e:
                raise InvalidRequestError(f"TRIODE_MAX_BODY_SIZE: {e}", field="max_body_size") from None
        if trust_request_chat_template is None:
            raw = environ.get("TRIODE_TRUST_REQUEST_CHAT_TEMPLATE", "").strip().lower()
            if raw not in ("", "0", "1", "true", "false", "yes", "no", "on", "off"):
                raise InvalidRequestError(f"TRIODE_TRUST_REQUEST_CHAT_TEMPLATE={raw!r} is not a boolean",
                                          field="trust_request_chat_template")
            trust_request_chat_template = raw in ("1", "true", "yes", "on")
        return cls(api_keys=api_keys, max_body_bytes=max_body_bytes,
                   trust_request_chat_template=trust_request_chat_template)


def served_model_name(args: EngineArgs) -> str:
    """The name clients send and see: --served-model-name, else the model argument (the
    default model's own name when none is given)."""
    if args.served_model_name:
        return args.served_model_name
    return DEFAULT_MODEL_NAME if args.model in (None, "default") else args.model
