"""GET /health, /version, /v1/models, /v1/models/<id> and /metrics."""

from __future__ import annotations

import time
from importlib import metadata

from quart import Blueprint, Response, jsonify

from triode.engine.lora.request import LoRARequest
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


def _model_card(lora: LoRARequest | None = None) -> dict:
    """The base model's card, or an adapter's (``parent``: the base model, ``root``: its files)."""
    engine_host = host()
    llm = engine_host.llm
    if lora is not None:
        root, parent = lora.lora_path, lora.base_model_name or engine_host.model_name
    else:
        root, parent = (llm.model_path if llm is not None else engine_host.args.model), None
    return {
        "id": engine_host.model_name if lora is None else lora.lora_name,
        "object": "model",
        "created": _STARTED,
        "owned_by": "triode",
        "root": root,
        "parent": parent,
        "max_model_len": llm.max_model_len if llm is not None and lora is None else None,
        "permission": [],
    }


@blueprint.get("/v1/models")
async def models() -> Response:
    adapters = host().adapters
    loras = adapters.adapters if adapters is not None else []
    return jsonify({"object": "list", "data": [_model_card(), *map(_model_card, loras)]})


@blueprint.get("/v1/models/<path:model>")
async def model(model: str) -> Response:
    return jsonify(_model_card(check_model(model)))


@blueprint.get("/metrics")
async def metrics() -> Response:
    server_metrics = host().metrics  # None only before the engine was first ready
    return Response(server_metrics.render() if server_metrics is not None else b"", content_type=CONTENT_TYPE)
