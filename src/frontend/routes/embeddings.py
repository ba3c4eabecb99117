"""POST /v1/embeddings: one engine request per input, up to ``SUBMITTED_AT_ONCE`` of them
in the engine at a time; the answer comes when all are embedded. A client that disconnects
cancels the handler, which aborts them all."""

from __future__ import annotations

import trio
from quart import Blueprint, Response, jsonify, request

from triode.engine.errors import TriodeError
from triode.engine.outputs import EmbeddingRequestOutput
from triode.frontend.openai.embeddings import embeddings_response, parse_embeddings
from triode.frontend.openai.errors import APIError, from_engine_error
from triode.frontend.openai.request_body import read_json_object
from triode.frontend.routes import check_model, generation, host, request_id

blueprint = Blueprint("embeddings", __name__)
SUBMITTED_AT_ONCE = 128


@blueprint.post("/v1/embeddings")
async def embeddings() -> Response:
    parsed = parse_embeddings(await read_json_object(request))
    check_model(parsed.model)
    engine_host = host()
    llm = engine_host.require_ready()
    ids = generation.engine_request_ids(request_id(), len(parsed.inputs))
    results: list[EmbeddingRequestOutput | None] = [None] * len(parsed.inputs)

    # At most so many of them in the engine's intake queue at once: a request of 2048 inputs
    # must not overflow the queue it shares with everyone (each waits for a slot instead).
    slots = trio.CapacityLimiter(min(SUBMITTED_AT_ONCE, max(1, llm.args.max_queued_requests // 2)))

    async def embed(index: int) -> None:
        async with slots:
            async for output in llm.encode(parsed.inputs[index], parsed.params, ids[index],
                                           priority=parsed.priority):
                results[index] = output

    try:
        async with trio.open_nursery() as nursery:
            for index in range(len(parsed.inputs)):
                nursery.start_soon(embed, index)
    except ExceptionGroup as group:  # the first failure names the problem
        raise from_engine_error(_first(group), {"request_id": "X-Request-Id", "prompt": "input"}) from None
    if any(result is None for result in results):  # aborted (the server is shutting down)
        raise APIError(503, "the server aborted the request before it finished (it is shutting down)",
                       code="aborted")
    return jsonify(embeddings_response([r for r in results if r is not None], model=engine_host.model_name,
                                       encoding_format=parsed.encoding_format))


def _first(group: ExceptionGroup) -> Exception:
    leaves: list[Exception] = []
    pending: list[Exception] = [group]
    while pending:
        error = pending.pop(0)
        if isinstance(error, ExceptionGroup):
            pending[:0] = list(error.exceptions)
        else:
            leaves.append(error)
    return next((e for e in leaves if isinstance(e, TriodeError | APIError)), leaves[0])
