"""POST /v1/messages (Anthropic's Messages API, streamed or not) and
POST /v1/messages/count_tokens, over the same engine requests as chat completions: a client
that disconnects aborts its request, and errors come back in Anthropic's shape (the app's
error handlers pick it for this path)."""

from __future__ import annotations

import attrs
import trio
from quart import Blueprint, Response, jsonify, request

from triode.engine.errors import InvalidRequestError
from triode.frontend.anthropic.errors import error_body
from triode.frontend.anthropic.messages import MessageBuilder
from triode.frontend.anthropic.requests import parse_count_tokens, parse_messages_request
from triode.frontend.openai import sse
from triode.frontend.openai.errors import from_engine_error
from triode.frontend.openai.request_body import read_json_object
from triode.frontend.routes import (
    chat_serving,
    check_chat_template,
    check_model,
    generation,
    host,
    request_id,
    response_model_name,
    with_server_chat_template,
)

PREFIX = "/v1/messages"
blueprint = Blueprint("messages", __name__)


@blueprint.post(PREFIX)
async def messages() -> Response:
    parsed = parse_messages_request(await read_json_object(request), host().generation, chat_serving())
    lora = check_model(parsed.model)
    parsed = attrs.evolve(parsed, chat=with_server_chat_template(parsed.chat))
    engine_host = host()
    builder = MessageBuilder(parsed, message_id=f"msg_{request_id()}", model=response_model_name(lora))
    jobs = await generation.start(engine_host, parsed, request_id(), lora=lora)
    if not parsed.stream.stream:
        [(_, final)] = await generation.finals(jobs)
        return jsonify(builder.full(final))
    return Response(sse.event_stream(generation.events(jobs, builder), typed=True, error_body=error_body),
                    content_type=sse.CONTENT_TYPE, headers=sse.HEADERS)


@blueprint.post(PREFIX + "/count_tokens")
async def count_tokens() -> Response:
    model, chat = parse_count_tokens(await read_json_object(request), chat_serving())
    check_model(model)
    check_chat_template(chat)
    chat = with_server_chat_template(chat)
    llm = host().require_ready()
    processor = llm.intake.processor

    def count() -> int:
        return len(processor.encode(processor.render_chat(chat), add_special_tokens=False, field="messages"))

    try:
        tokens = await trio.to_thread.run_sync(count)
    except InvalidRequestError as error:
        raise from_engine_error(error) from None
    return jsonify({"input_tokens": tokens})
