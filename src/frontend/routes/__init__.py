"""The HTTP routes, one blueprint per concern, and what they share: the app's EngineHost,
the ``model`` check, and the request id (``X-Request-Id``, honoured and echoed)."""

from __future__ import annotations

import re
import uuid

import attrs
from quart import Quart, current_app, g, request

from triode.engine.chat_options import ChatOptions
from triode.engine.lora.request import LoRARequest
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


def check_model(model: str | None) -> LoRARequest | None:
    """The LoRA adapter ``model`` names, or None for the base model (``model`` may be omitted);
    any other name is a 404 that lists what the server serves."""
    engine_host = host()
    adapters = engine_host.adapters
    if adapters is None:  # not ready yet: only the base model's name is known
        if model is not None and model != engine_host.model_name:
            raise APIError(404, f"the model {model!r} does not exist; this server serves "
                                f"{engine_host.model_name!r}", param="model", code="model_not_found")
        return None
    return adapters.resolve(model)


def response_model_name(lora: LoRARequest | None) -> str:
    """The ``model`` a response names: the adapter's, or the served model's."""
    return host().model_name if lora is None else lora.lora_name


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
    if app.extensions["triode.settings"].allow_runtime_lora_updating:
        from triode.frontend.routes.lora import blueprint as lora

        app.register_blueprint(lora)
    if app.extensions["triode.settings"].server_dev_mode:
        from triode.frontend.routes.cache import blueprint as cache

        app.register_blueprint(cache)

    @app.after_request
    async def _echo_request_id(response):
        if "request_id" in g:
            response.headers["X-Request-Id"] = g.request_id
        elif (given := request.headers.get("X-Request-Id")) and _REQUEST_ID.fullmatch(given):
            response.headers["X-Request-Id"] = given
        return response
