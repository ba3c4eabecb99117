"""The quart-trio app factory and its lifespan.

The lifespan opens the nursery that owns the engine (quart-trio cancels ``app.nursery``
before ``after_serving`` runs, which would cut the drain short): start-up loads the model and
returns once the engine is ready, so hypercorn listens only when /health can say 200; shutdown
drains in-flight requests, then stops the engine and its worker processes.

Under an ASGI server that does not run trio (plain ``hypercorn triode.frontend:app`` uses asyncio)
the lifespan refuses to start, naming ``--worker-class trio``, so the server exits instead of
answering every request with a 500."""

from __future__ import annotations

import multiprocessing
import sys

import trio
from quart import request
from quart_trio import QuartTrio
from quart_trio.asgi import TrioASGIHTTPConnection, TrioASGILifespan

from triode.engine.config import EngineArgs
from triode.engine.errors import TriodeError
from triode.frontend.anthropic.errors import error_body as anthropic_error_body
from triode.frontend.openai.errors import register_error_handlers
from triode.frontend.responses.store import ResponseStore
from triode.frontend.routes import register_routes
from triode.frontend.server.auth import install_auth
from triode.frontend.server.lifecycle import EngineHost
from triode.frontend.server.settings import ServerSettings

TRIO_REQUIRED = (
    "triode's HTTP server runs on trio, and this ASGI server is not running a trio event loop: "
    "start it with `hypercorn --worker-class trio triode.frontend:app` (or `triode serve`)"
)


def _trio_running() -> bool:
    try:
        trio.lowlevel.current_trio_token()
    except RuntimeError:
        return False
    return True


class TriodeLifespan(TrioASGILifespan):
    async def __call__(self, receive, send) -> None:
        if not _trio_running():
            await _refuse(receive, send)
            return
        engine_host: EngineHost = self.app.extensions["triode"]
        async with trio.open_nursery() as nursery:
            engine_host.nursery = nursery
            try:
                await super().__call__(receive, send)
            finally:
                nursery.cancel_scope.cancel()


async def _refuse(receive, send) -> None:
    """Plain awaits only: this runs on whatever loop the server has (asyncio, for hypercorn)."""
    print(f"triode: error: {TRIO_REQUIRED}", file=sys.stderr, flush=True)
    message = await receive()
    if message["type"] == "lifespan.startup":
        await send({"type": "lifespan.startup.failed", "message": TRIO_REQUIRED})


def _allow_worker_processes() -> None:
    # hypercorn runs its workers as daemonic processes, which multiprocessing forbids to have
    # children; the engine's workers are children of this process and are stopped with it.
    process = multiprocessing.current_process()
    if process.daemon:
        process._config["daemon"] = False


# How long a response's end waits for the rest of a request body it answered before reading
# (a 413), as a server's lingering close does.
UNREAD_BODY_WAIT_S = 10.0


class TriodeHTTPConnection(TrioASGIHTTPConnection):
    """Ends a response only once the request's body has arrived (within UNREAD_BODY_WAIT_S),
    and sends that last message shielded from the request's cancellation.

    hypercorn closes or recycles the connection inside that last send, and quart-trio cancels
    the request as soon as hypercorn tells it the stream closed: unshielded, a close (after a
    413, which answers before the body is read) was cut short and never came, and the client's
    next request on the connection hung. Closed while the client still sent its body, the
    client's write failed, and asyncio clients dropped the connection with the 413 unread."""

    async def __call__(self, receive, send) -> None:
        body_received = trio.Event()

        async def tracked_receive():
            message = await receive()
            if message["type"] == "http.disconnect" or not message.get("more_body", False):
                body_received.set()
            return message

        async def send_last_after_the_body(message) -> None:
            if message["type"] != "http.response.body" or message.get("more_body", False):
                await send(message)
                return
            with trio.CancelScope(shield=True):
                with trio.move_on_after(UNREAD_BODY_WAIT_S):
                    await body_received.wait()  # quart-trio's own task receives it
                await send(message)

        await super().__call__(tracked_receive, send_last_after_the_body)


class TriodeApp(QuartTrio):
    asgi_lifespan_class = TriodeLifespan
    asgi_http_class = TriodeHTTPConnection

    def log_exception(self, exception_info) -> None:
        # A failure triode raises on purpose (a model that cannot load, say) has a message that
        # says it all; a traceback would bury it. Anything else keeps its traceback.
        error = exception_info[1]
        if isinstance(error, TriodeError):
            self.logger.error("%s", error)
        else:
            super().log_exception(exception_info)


def create_app(engine_args: EngineArgs | None = None, settings: ServerSettings | None = None) -> TriodeApp:
    """``engine_args``: None reads TRIODE_* variables at start-up. ``settings``: None reads
    TRIODE_API_KEY and TRIODE_MAX_BODY_SIZE now."""
    settings = settings if settings is not None else ServerSettings.from_env()
    app = TriodeApp("triode")
    app.config.update(
        RESPONSE_TIMEOUT=None,  # quart's default (60 s) would cut long streams
        BODY_TIMEOUT=60,  # seconds to receive a request body
        MAX_CONTENT_LENGTH=settings.max_body_bytes,
    )
    app.json.sort_keys = False
    engine_host = EngineHost(engine_args, settings.lora_modules)
    app.extensions["triode"] = engine_host
    app.extensions["triode.settings"] = settings
    app.extensions["triode.responses"] = ResponseStore(max_size=settings.responses_store_size,
                                                      max_age=settings.responses_store_max_age)

    @app.before_serving
    async def _start_engine() -> None:
        _allow_worker_processes()
        await engine_host.start()

    @app.after_serving
    async def _stop_engine() -> None:
        await engine_host.close()

    @app.before_request
    async def _read_body_first() -> None:
        # Every request body is received before any response, errors included: with hypercorn's
        # trio worker, answering a keep-alive request whose body the app never read leaves some
        # connections stuck, and the client's next request on them hangs (seen as read timeouts
        # on about 1 in 100 fast 404s under 16 concurrent clients). Bodies are bounded by
        # MAX_CONTENT_LENGTH (413 beyond it).
        if request.method not in ("GET", "HEAD", "OPTIONS"):
            await request.get_data(cache=True)

    register_error_handlers(app, shapes={"/v1/messages": anthropic_error_body})
    install_auth(app, settings.api_keys)
    register_routes(app)
    return app
