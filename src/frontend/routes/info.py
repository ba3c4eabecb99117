"""GET /health, /version, /v1/models, /v1/models/<id> and /metrics."""

from __future__ import annotations

import time
from importlib import metadata

from quart import Blueprint, Response, jsonify

from triode.frontend.routes import check_model, host
from triode.frontend.server.metrics import CONTENT_TYPE

blueprint = Blueprint("info", __name__)
_STARTED = int(time.time())


@blueprint.get("/health")
async def health() -> Response:
    """200 once the model is loaded; 503 while loading, restarting workers, draining, or dead."""
    llm = host().require_ready()  # raises the 503 that names the state
    if llm.supervisor.restarting:
        # Requests are still accepted (they queue and wait); a balancer should look elsewhere.
        return jsonify({"status": "restarting"}), 503
    return jsonify({"status": "ready"})


@blueprint.get("/version")
async def version() -> Response:
    try:
        number = metadata.version("triode")
    except metadata.PackageNotFoundError:
        number = "unknown"
    return jsonify({"version": number})


def _model_card() -> dict:
    engine_host = host()
    llm = engine_host.llm
    return {
        "id": engine_host.model_name,
        "object": "model",
        "created": _STARTED,
        "owned_by": "triode",
        "root": llm.model_path if llm is not None else engine_host.args.model,
        "parent": None,
        "max_model_len": llm.max_model_len if llm is not None else None,
        "permission": [],
    }


@blueprint.get("/v1/models")
async def models() -> Response:
    return jsonify({"object": "list", "data": [_model_card()]})


@blueprint.get("/v1/models/<path:model>")
async def model(model: str) -> Response:
    check_model(model)
    return jsonify(_model_card())


@blueprint.get("/metrics")
async def metrics() -> Response:
    server_metrics = host().metrics  # None only before the engine was first ready
    return Response(server_metrics.render() if server_metrics is not None else b"", content_type=CONTENT_TYPE)
