"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

Handlers raise ``APIError``; engine errors and HTTP exceptions (404 route, 405, 413...) are
mapped here, so every failure a client can cause comes back as a 4xx in that shape, and an
unexpected one as a 500 in the same shape (logged with its traceback). An API with an error
shape of its own (Anthropic's, under ``/v1/messages``) names its path prefix and its shape
when the handlers are registered."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

from quart import Quart, Response, jsonify, request
from werkzeug.exceptions import HTTPException

from triode.engine.errors import (
    EngineDeadError,
    EngineShutdownError,
    InvalidRequestError,
    QueueFull,
)

log = logging.getLogger("triode.frontend")

RETRY_AFTER_SECONDS = 1

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    409: "conflict_error",
    413: "invalid_request_error",
    503: "service_unavailable_error",
}


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self, shape: ErrorShape | None = None) -> Response:
        response = jsonify(self.body() if shape is None else shape(self))
        response.status_code = self.status
        for name, value in self.headers.items():
            response.headers[name] = value
        return response


ErrorShape = Callable[[APIError], dict]


def renamed(error: APIError, *names: tuple[str, str]) -> APIError:
    """``error`` with its field named as another API spells it: each (ours, theirs) replaced in
    ``param`` and the message (chat's ``tools[0].function.name`` is Responses' ``tools[0].name``)."""
    for ours, theirs in names:
        error.param = error.param and error.param.replace(ours, theirs)
        error.message = error.message.replace(ours, theirs)
    return error


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def from_engine_error(error: Exception, param_names: Mapping[str, str] | None = None) -> APIError:
    """The HTTP meaning of an error the engine raised for one request. ``param_names``: the
    request's own name for an engine field (``response_format.json_schema.schema`` for
    ``structured_outputs.json``), used in the message and as ``param``."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, InvalidRequestError):
        code = "context_length_exceeded" if "maximum length" in str(error) else None
        message, param = str(error), error.field
        if param is not None and param_names and param in param_names:
            param = param_names[param]
            message = param + message[len(error.field):] if message.startswith(error.field) else message
        return APIError(400, message, param=param, code=code)
    if isinstance(error, QueueFull):
        return APIError(503, str(error), code="overloaded",
                        headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
    if isinstance(error, EngineShutdownError):
        return shutting_down()
    if isinstance(error, EngineDeadError):
        return APIError(503, str(error), code="engine_dead")
    log.error("unexpected error while serving a request", exc_info=error)
    return APIError(500, f"internal error: {type(error).__name__}", code="internal_error")


def shutting_down() -> APIError:
    return APIError(503, "the server is shutting down and accepts no new requests", code="draining",
                    headers={"Retry-After": str(RETRY_AFTER_SECONDS)})


_HTTP_MESSAGES = {
    404: "no such route: {method} {path}",
    405: "method {method} is not allowed on {path}",
    413: "the request body is larger than the limit of {limit} bytes",
}


def register_error_handlers(app: Quart, *, shapes: Mapping[str, ErrorShape] | None = None) -> None:
    """``shapes``: a path prefix -> the error body of the API served under it."""

    def shape() -> ErrorShape | None:
        for prefix, body in (shapes or {}).items():
            if request.path == prefix or request.path.startswith(prefix + "/"):
                return body
        return None

    @app.errorhandler(APIError)
    async def _api_error(error: APIError) -> Response:
        return error.response(shape())

    @app.errorhandler(HTTPException)
    async def _http_error(error: HTTPException) -> Response:
        status = error.code or 500
        template = _HTTP_MESSAGES.get(status)
        message = (
            template.format(method=request.method, path=request.path, limit=app.config["MAX_CONTENT_LENGTH"])
            if template else (error.description or error.name)
        )
        code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(status)
        api_error = APIError(status, message, code=code)
        response = api_error.response(shape())
        valid_methods = getattr(error, "valid_methods", None)
        if status == 405 and valid_methods:
            response.headers["Allow"] = ", ".join(valid_methods)
        if status == 413:
            # Answered before the rest of the body was read: the connection cannot carry another
            # request (a client that sent one on it waited forever), so it closes after this.
            response.headers["Connection"] = "close"
        return response

    @app.errorhandler(Exception)
    async def _unexpected(error: Exception) -> Response:
        return from_engine_error(error).response(shape())
