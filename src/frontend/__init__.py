"""triode's OpenAI-compatible HTTP frontend (quart-trio).

``triode.frontend:app`` serves the model named by ``TRIODE_MODEL`` (and the other ``TRIODE_*``
engine settings; ``TRIODE_API_KEY`` for keys) under hypercorn's trio worker::

    TRIODE_MODEL=/path/to/model hypercorn --worker-class trio --bind 127.0.0.1:8000 triode.frontend:app

``app`` is a thin ASGI callable that builds the quart-trio app (``triode.frontend.server.factory``) on its
first call, reading the configuration then: importing this package stays cheap, which matters
because every module of the ``triode`` command (and so every engine worker process, which
re-imports the command's script) imports it. ``triode serve`` runs the same app in-process.
"""

from __future__ import annotations

from typing import Any


class _App:
    """The ASGI entry point for ``hypercorn --worker-class trio triode.frontend:app``."""

    def __init__(self) -> None:
        self._app: Any = None

    @property
    def quart(self) -> Any:
        """The quart-trio app, built on first use from TRIODE_* variables."""
        if self._app is None:
            from triode.frontend.server.factory import create_app

            self._app = create_app()
        return self._app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        await self.quart(scope, receive, send)


app = _App()

__all__ = ["app"]
