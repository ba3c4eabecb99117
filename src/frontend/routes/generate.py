"""POST /v1/completions and POST /v1/chat/completions, streamed (SSE) or not.

A client that disconnects cancels the handler (before a non-streamed response is ready) or
the body generator (mid-stream); either way closing the engine requests aborts them and the
scheduler frees their KV blocks before its next step."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any

import attrs
from quart import Blueprint, Response, jsonify, request

from triode.frontend.openai import sse
from triode.frontend.openai.request_body import read_json_object
from triode.frontend.openai.requests import (
    GenerationRequest,
    parse_chat,
    parse_completion,
)
from triode.frontend.openai.responses import ResponseBuilder
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

blueprint = Blueprint("generate", __name__)


@blueprint.post("/v1/completions")
async def completions() -> Response:
    body = await read_json_object(request)
    return await _serve(parse_completion(body, host().generation), prefix="cmpl")


@blueprint.post("/v1/chat/completions")
async def chat_completions() -> Response:
    body = await read_json_object(request)
    return await _serve(parse_chat(body, host().generation, chat_serving()), prefix="chatcmpl")


async def _serve(parsed: GenerationRequest, *, prefix: str) -> Response:
    lora = check_model(parsed.model)
    check_chat_template(parsed.chat)
    parsed = attrs.evolve(parsed, chat=with_server_chat_template(parsed.chat))
    engine_host = host()
    llm = engine_host.require_ready()
    base_id = request_id()
    assert engine_host.token_text is not None
    builder = ResponseBuilder(parsed, response_id=f"{prefix}-{base_id}", model=response_model_name(lora),
                              tokenizer=llm.tokenizer, token_text=engine_host.token_text)
    jobs = await generation.start(engine_host, parsed, base_id, lora=lora)
    if not parsed.stream.stream:
        return jsonify(builder.full(await generation.finals(jobs)))
    return Response(sse.event_stream(_chunks(builder, jobs)), content_type=sse.CONTENT_TYPE,
                    headers=sse.HEADERS)


async def _chunks(builder: ResponseBuilder, jobs: list[generation.Job]) -> AsyncGenerator[dict[str, Any], None]:
    outputs = generation.outputs(jobs)
    try:
        async for prompt_index, output in outputs:
            for chunk in builder.chunks(prompt_index, output):
                yield chunk
        if builder.request.stream.include_usage:
            yield builder.usage_chunk()
    finally:
        await outputs.aclose()
