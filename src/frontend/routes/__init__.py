"""The HTTP routes, one blueprint per concern, and what they share: the app's EngineHost,
the ``model`` check, and the request id (``X-Request-Id``, honoured and echoed)."""

from __future__ import annotations

import re
import uuid

import attrs
from quart import Quart, current_app, g, request

from triode.engine.inputs import ChatOptions
from triode.frontend.openai.errors import APIError
from triode.frontend.openai.requests import ChatServing
from triode.frontend.server.lifecycle import EngineHost

_REQUEST_ID = re.compile(r"[\x21-\x7e]{1,256}")


def host() -> EngineHost:
    return current_app.extensions["triode"]


def chat_serving() -> ChatServing:
    """What the server was started with that shapes chat-like requests (every API's)."""
    settings = current_app.extensions["triode.settings"]
    return ChatServing(tool_call_parser=settings.tool_call_parser,
                       enable_auto_tool_choice=settings.enable_auto_tool_choice,
                       reasoning_parser=host().args.reasoning_parser)


def check_model(model: str | None) -> None:
    """``model`` may be omitted (the served model); any other name is a 404."""
    served = host().model_name
    if model is not None and model != served:
        raise APIError(404, f"the model {model!r} does not exist; this server serves {served!r}",
                       param="model", code="model_not_found")


def check_chat_template(chat: ChatOptions | None) -> None:
    """A request's own chat template only where the server trusts its clients (settings)."""
    if chat is None or chat.chat_template is None:
        return
    if not current_app.extensions["triode.settings"].trust_request_chat_template:
        raise APIError(400, "chat_template: this server does not take chat templates from requests "
                            "(start it with --trust-request-chat-template to allow them)",
                       param="chat_template", code="untrusted_chat_template")


def with_server_chat_template(chat: ChatOptions | None) -> ChatOptions | None:
    """A chat without a template of its own gets the server's ``--chat-template``, if any
    (after ``check_chat_template``: the server's own template is trusted)."""
    template = current_app.extensions["triode.settings"].chat_template
    if chat is None or chat.chat_template is not None or template is None:
        return chat
    return attrs.evolve(chat, chat_template=template)


def request_id() -> str:
    if "request_id" not in g:
        given = request.headers.get("X-Request-Id")
        if given is not None and not _REQUEST_ID.fullmatch(given):
            raise APIError(400, "X-Request-Id: expected 1 to 256 visible ASCII characters",
                           param="X-Request-Id")
        g.request_id = given or uuid.uuid4().hex
    return g.request_id


def register_routes(app: Quart) -> None:
    from triode.frontend.routes.embeddings import blueprint as embeddings
    from triode.frontend.routes.generate import blueprint as generate
    from triode.frontend.routes.info import blueprint as info
    from triode.frontend.routes.messages import blueprint as messages
    from triode.frontend.routes.responses import blueprint as responses
    from triode.frontend.routes.tokens import blueprint as tokens

    app.register_blueprint(generate)
    app.register_blueprint(embeddings)
    app.register_blueprint(info)
    app.register_blueprint(messages)
    app.register_blueprint(responses)
    app.register_blueprint(tokens)

    @app.after_request
    async def _echo_request_id(response):
        if "request_id" in g:
            response.headers["X-Request-Id"] = g.request_id
        elif (given := request.headers.get("X-Request-Id")) and _REQUEST_ID.fullmatch(given):
            response.headers["X-Request-Id"] = given
        return response
