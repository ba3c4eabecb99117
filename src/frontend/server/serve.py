"""``triode serve``: the app under hypercorn's trio server, in this process.

Prints the URL once the model is loaded. The first SIGTERM or SIGINT starts a drain: new
requests get 503 (the socket stays open, so clients see a status rather than a refused
connection), in-flight ones get up to --shutdown-timeout seconds to finish, the rest are
aborted (finish_reason "abort"); then hypercorn closes, the engine stops its workers and the
process exits 0. A second signal aborts at once."""

from __future__ import annotations

import logging
import math
import signal
import sys

import trio
from hypercorn.config import Config, Sockets
from hypercorn.trio.run import worker_serve
from hypercorn.utils import LifespanFailureError, wrap_app
from quart_trio import QuartTrio

from triode.frontend.server.lifecycle import ABORT_GRACE_SECONDS, EngineHost

log = logging.getLogger("triode.frontend")


def hypercorn_config(host: str, port: int, *, shutdown_timeout: float) -> Config:
    config = Config()
    config.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    config.startup_timeout = math.inf  # the first run may download and convert the model
    config.shutdown_timeout = shutdown_timeout + ABORT_GRACE_SECONDS + 60
    config.graceful_timeout = 5  # connections still open after our drain
    config.accesslog = None
    config.errorlog = "-"
    return config


def run(app: QuartTrio, *, host: str, port: int) -> int:
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    logging.getLogger("triode").addHandler(handler)
    logging.getLogger("triode").setLevel(logging.INFO)
    engine_host: EngineHost = app.extensions["triode"]
    config = hypercorn_config(host, port, shutdown_timeout=engine_host.args.shutdown_timeout)
    try:  # before the model loads: a taken port fails at once, not after a minute of loading
        sockets = config.create_sockets()
    except OSError as e:
        print(f"triode: error: cannot listen on {host}:{port}: {e.strerror or e}", file=sys.stderr, flush=True)
        return 2
    print(f"triode: loading {engine_host.model_name} ...", flush=True)
    failures: list[BaseException] = []
    try:
        for sock in sockets.insecure_sockets:
            sock.listen(config.backlog)
        return trio.run(_main, app, engine_host, config, sockets)
    except* LifespanFailureError as group:
        failures.extend(_leaves(group))
    finally:
        for sock in sockets.insecure_sockets:
            sock.close()
    message = "; ".join(str(e) for e in failures)
    print(f"triode: error: the server could not start: {message}", file=sys.stderr, flush=True)
    return 2


def _leaves(error: BaseException) -> list[BaseException]:
    if isinstance(error, BaseExceptionGroup):
        return [leaf for inner in error.exceptions for leaf in _leaves(inner)]
    return [error]


async def _main(app: QuartTrio, engine_host: EngineHost, config: Config, sockets: Sockets) -> int:
    shutdown = trio.Event()
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_on_signals, signals, engine_host, shutdown, nursery)
            binds = await nursery.start(_serve, app, config, sockets, shutdown, nursery.cancel_scope)
            # hypercorn binds even when start-up failed (the failure then cancels it): say
            # "serving" only when the engine really is ready.
            for url in binds if engine_host.state == "ready" else ():
                print(f"triode: serving {engine_host.model_name} at {url} "
                      f"(OpenAI base URL {url}/v1); Ctrl-C to stop", flush=True)
    print("triode: stopped", flush=True)
    return 0


async def _serve(app, config: Config, sockets: Sockets, shutdown: trio.Event, scope: trio.CancelScope, *,
                 task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> None:
    # hypercorn.trio.serve() minus its socket creation (done above, before the model loads).
    await worker_serve(wrap_app(app, config.wsgi_max_body_size, "asgi"), config, sockets=sockets,
                       shutdown_trigger=shutdown.wait, task_status=task_status)
    scope.cancel()  # the signal watcher


async def _on_signals(signals, engine_host: EngineHost, shutdown: trio.Event, nursery: trio.Nursery) -> None:
    async for signum in signals:
        name = signal.Signals(signum).name
        if engine_host.state in ("stopped", "loading"):
            print(f"triode: {name} during start-up; stopping", file=sys.stderr, flush=True)
            nursery.cancel_scope.cancel()
            return
        if not shutdown.is_set() and engine_host.state != "draining":
            window = engine_host.args.shutdown_timeout
            print(f"triode: {name}: draining (up to {window:g} s); send it again to abort now",
                  file=sys.stderr, flush=True)
            nursery.start_soon(_drain_then_stop, engine_host, shutdown)
        else:
            print(f"triode: {name}: aborting the remaining requests", file=sys.stderr, flush=True)
            await engine_host.abort_all()
            shutdown.set()


async def _drain_then_stop(engine_host: EngineHost, shutdown: trio.Event) -> None:
    await engine_host.drain()
    shutdown.set()

