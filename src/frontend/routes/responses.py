"""OpenAI's Responses API: ``POST /v1/responses`` (whole, streamed, or in the background),
``GET`` and ``DELETE /v1/responses/{id}``, ``POST /v1/responses/{id}/cancel``.

A stored response (``store``, the default) keeps its conversation in the server's bounded
store for ``previous_response_id``. A background response runs in a task of the engine's
nursery after the handler answered ``in_progress`` (the request was validated and accepted
first, so bad input is still a 4xx); cancelling it aborts its engine request. A streamed
response whose client leaves is aborted like a chat stream and stored as ``cancelled``."""

from __future__ import annotations

import uuid
from collections.abc import AsyncGenerator
from typing import Any

import attrs
import trio
from quart import Blueprint, Response, current_app, jsonify, request

from triode.frontend.openai import sse
from triode.frontend.openai.errors import APIError, bad_request, from_engine_error
from triode.frontend.openai.request_body import read_json_object
from triode.frontend.responses.output import ResponseBuilder
from triode.frontend.responses.requests import parse_responses_request
from triode.frontend.responses.store import ResponseStore
from triode.frontend.routes import (
    chat_serving,
    check_model,
    generation,
    host,
    request_id,
    response_model_name,
    with_server_chat_template,
)

blueprint = Blueprint("responses", __name__)
Items = tuple[dict[str, Any], ...]


def store() -> ResponseStore:
    return current_app.extensions["triode.responses"]


def _stored(response_id: str, param: str | None = None):
    entry = store().get(response_id)
    if entry is None:
        message = (f"no stored response with id {response_id!r} (unknown, deleted, or older than the "
                   f"store keeps: {store().max_size} responses, {store().max_age:g} s)")
        if param is not None:  # a request field naming it: a bad request, as in OpenAI's API
            raise bad_request(message, param=param)
        raise APIError(404, message, code="response_not_found")
    return entry


@blueprint.post("/v1/responses")
async def create() -> Response:
    serving = chat_serving()
    parsed = parse_responses_request(await read_json_object(request), host().generation, serving)
    lora = check_model(parsed.model)
    if parsed.background and store().max_size == 0:
        raise bad_request("background: the server keeps no responses (--responses-store-size 0), so a "
                          "background response could never be read", param="background")
    history: Items = ()
    if parsed.previous_response_id is not None:
        previous = _stored(parsed.previous_response_id, param="previous_response_id")
        if previous.response["status"] in ("queued", "in_progress"):
            raise bad_request(f"previous_response_id: {parsed.previous_response_id!r} has not finished",
                              param="previous_response_id")
        history = previous.items
    engine_request = parsed.generation(history, serving)
    engine_request = attrs.evolve(engine_request, chat=with_server_chat_template(engine_request.chat))
    engine_host = host()
    llm = engine_host.require_ready()
    builder = ResponseBuilder(engine_request, parsed.echo, response_id=f"resp_{uuid.uuid4().hex}",
                              model=response_model_name(lora),
                              count_tokens=lambda text: len(llm.tokenizer.encode(text, add_special_tokens=False)))
    jobs = await generation.start(engine_host, engine_request, request_id(), lora=lora)
    items = (*history, *parsed.input_items)
    if parsed.background:
        assert engine_host.nursery is not None
        finished = trio.Event()
        scope = trio.CancelScope()

        async def cancel() -> None:
            scope.cancel()
            await finished.wait()

        store().put(builder.response("in_progress"), items, cancel=cancel)
        engine_host.nursery.start_soon(_background, store(), builder, jobs, items, scope, finished)
        return jsonify(builder.response("in_progress"))
    if not parsed.stream:
        [(_, final)] = await generation.finals(jobs)
        body = builder.full(final)
        if parsed.store:
            store().put(body, (*items, *body["output"]))
        return jsonify(body)
    if parsed.store:
        store().put(builder.response("in_progress"), items)
    return Response(sse.event_stream(_events(builder, jobs, store() if parsed.store else None, items), typed=True,
                                     error_body=builder.error_event),
                    content_type=sse.CONTENT_TYPE, headers=sse.HEADERS)


async def _events(builder: ResponseBuilder, jobs: list[generation.Job], responses: ResponseStore | None,
                  items: Items) -> AsyncGenerator[dict[str, Any], None]:
    """The body's events; ``responses``: where the response is stored (the body outlives the
    request's app context)."""
    stream = generation.events(jobs, builder)
    final: dict[str, Any] | None = None
    try:
        async for event in stream:
            if event["type"] in ("response.completed", "response.incomplete"):
                final = event["response"]
            yield event
    finally:
        await stream.aclose()
        if responses is not None and responses.get(builder.id) is not None:  # not deleted meanwhile
            if final is not None:
                responses.put(final, (*items, *final["output"]))
            else:
                responses.put(builder.response("cancelled"), items)


async def _background(responses: ResponseStore, builder: ResponseBuilder, jobs: list[generation.Job],
                      items: Items, scope: trio.CancelScope, finished: trio.Event) -> None:
    try:
        with scope:
            try:
                final = None
                async for _, output in generation.outputs(jobs):  # deltas, joined
                    final = output if final is None else final.followed_by(output)
                assert final is not None
                body = builder.full(final)
                responses.put(body, (*items, *body["output"]))
            except Exception as error:  # a bug must fail this response, not the server's nursery
                responses.put(builder.response("failed", error=from_engine_error(error)), items)
        if scope.cancelled_caught:
            responses.put(builder.response("cancelled"), items)
    finally:
        await generation.close(jobs)
        finished.set()


@blueprint.get("/v1/responses/<response_id>")
async def retrieve(response_id: str) -> Response:
    return jsonify(_stored(response_id).response)


@blueprint.delete("/v1/responses/<response_id>")
async def delete(response_id: str) -> Response:
    entry = _stored(response_id)
    if entry.cancel is not None and entry.response["status"] == "in_progress":
        await entry.cancel()
    store().delete(response_id)
    return jsonify({"id": response_id, "object": "response", "deleted": True})


@blueprint.post("/v1/responses/<response_id>/cancel")
async def cancel(response_id: str) -> Response:
    entry = _stored(response_id)
    if not entry.response.get("background"):
        raise bad_request(f"{response_id!r} was not created with background: only background responses "
                          "can be cancelled", param="response_id")
    if entry.cancel is not None and entry.response["status"] == "in_progress":
        await entry.cancel()
    return jsonify(_stored(response_id).response)
