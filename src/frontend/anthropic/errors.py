"""Errors in Anthropic's shape: ``{"type": "error", "error": {"type", "message"}}``, with
Anthropic's type names for the statuses we return (the message names the field)."""

from __future__ import annotations

from typing import Any

from triode.frontend.openai.errors import APIError

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def error_body(error: APIError) -> dict[str, Any]:
    kind = _TYPES.get(error.status, "invalid_request_error" if error.status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": error.message}}
