"""POST /reset_prefix_cache (vLLM's development endpoint): registered only in development mode
(``--server-dev-mode`` or vLLM's ``VLLM_SERVER_DEV_MODE``), as vLLM registers it.

The cache is emptied only while no request holds KV blocks: 200 when it was, a 409 otherwise,
where vLLM answers 200 either way. vLLM's ``reset_running_requests=true`` (preempt the running
requests first) and ``reset_external=true`` (a KV connector's cache too) are refused by name:
triode has neither, and answering 200 to them would claim what did not happen."""

from __future__ import annotations

from quart import Blueprint, Response, request

from triode.frontend.openai.errors import APIError, bad_request
from triode.frontend.routes import host
from triode.frontend.server.settings import boolean_word

blueprint = Blueprint("cache", __name__)

_UNSUPPORTED = ("reset_running_requests", "reset_external")


@blueprint.post("/reset_prefix_cache")
async def reset_prefix_cache() -> Response:
    for name in _UNSUPPORTED:
        asked = boolean_word(request.args.get(name, ""))
        if asked is None:
            raise bad_request(f"{name} must be true or false", param=name)
        if asked:
            raise bad_request(f"{name} is not supported: the cache is reset only while no request runs",
                              param=name)
    if not await host().require_ready().reset_prefix_cache():
        raise APIError(409, "requests are running and hold KV blocks: the prefix cache can be reset "
                            "once none runs", code="requests_running")
    return Response("", status=200)
