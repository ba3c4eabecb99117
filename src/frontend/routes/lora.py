"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's run-time adapter endpoints):
registered only where the server allows it (``--allow-runtime-lora-updating`` or vLLM's
``VLLM_ALLOW_RUNTIME_LORA_UPDATING``), as vLLM registers them.

A load reads and checks the adapter's files against the model before the name is served, so a
wrong adapter is a 400 naming it and the reason; the workers read its weights when a request
first uses it. An unload stops serving the name; requests already running with the adapter
finish with it."""

from __future__ import annotations

from quart import Blueprint, Response, request

from triode.engine.lora.peft_files import LoRAAdapterError
from triode.frontend.openai.errors import bad_request
from triode.frontend.openai.request_body import Reader, read_json_object
from triode.frontend.routes import host
from triode.frontend.server.adapters import ServedAdapters

blueprint = Blueprint("lora", __name__)


def _name_and_path(reader: Reader, *, path: bool) -> tuple[str, str | None]:
    name = reader.string("lora_name")
    if not name:
        raise reader.fail("lora_name", "is required")
    lora_path = reader.string("lora_path")
    if path and not lora_path:
        raise reader.fail("lora_path", "is required")
    reader.int("lora_int_id")  # vLLM's unload takes it, and ignores it: names are unique
    return name, lora_path


def _adapters() -> ServedAdapters:
    engine_host = host()
    engine_host.require_ready()
    assert engine_host.adapters is not None  # set before the engine is ready
    return engine_host.adapters


@blueprint.post("/v1/load_lora_adapter")
async def load() -> Response:
    reader = Reader(await read_json_object(request), "/v1/load_lora_adapter")
    name, path = _name_and_path(reader, path=True)
    in_place = reader.bool("load_inplace", False)
    adapters = _adapters()
    try:
        await adapters.load(host().require_ready(), name, path or "", in_place=in_place)
    except LoRAAdapterError as error:
        raise bad_request(str(error), param="lora_path") from None
    return Response(f"Success: LoRA adapter '{name}' added successfully.", content_type="text/plain")


@blueprint.post("/v1/unload_lora_adapter")
async def unload() -> Response:
    reader = Reader(await read_json_object(request), "/v1/unload_lora_adapter")
    name, _ = _name_and_path(reader, path=False)
    _adapters().unload(name)
    return Response(f"Success: LoRA adapter '{name}' removed successfully.", content_type="text/plain")
