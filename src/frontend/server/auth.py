"""API keys: with one or more keys configured, every ``/v1/*`` route needs
``Authorization: Bearer <key>`` (OpenAI's clients) or ``x-api-key: <key>`` (Anthropic's). Keys are compared in constant time, against every configured
key (no early exit), so neither a key's content nor which key matched shows in the timing.
``/health``, ``/metrics`` and the other routes outside ``/v1`` stay open."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence

from quart import Quart, request

from triode.frontend.openai.errors import APIError

PROTECTED_PREFIX = "/v1"


def _digest(key: str) -> bytes:
    # Equal-length inputs for compare_digest, whatever the lengths of the keys.
    return hashlib.sha256(key.encode("utf-8", errors="surrogatepass")).digest()


class KeyChecker:
    def __init__(self, keys: Sequence[str]) -> None:
        self._digests = [_digest(k) for k in keys]

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    def accepts(self, authorization: str | None, api_key: str | None = None) -> bool:
        """``authorization``: the Authorization header; ``api_key``: the x-api-key header."""
        if authorization is not None:
            scheme, _, token = authorization.partition(" ")
            if scheme.lower() != "bearer":
                return False
        elif api_key is not None:
            token = api_key
        else:
            return False
        given = _digest(token.strip())
        matched = False
        for digest in self._digests:
            matched |= hmac.compare_digest(given, digest)
        return matched


def install_auth(app: Quart, keys: Sequence[str]) -> None:
    checker = KeyChecker(keys)
    if not checker.enabled:
        return

    @app.before_request
    async def _require_key() -> None:
        path = request.path
        if path != PROTECTED_PREFIX and not path.startswith(PROTECTED_PREFIX + "/"):
            return
        if not checker.accepts(request.headers.get("Authorization"), request.headers.get("x-api-key")):
            raise APIError(
                401,
                "invalid or missing API key: send the header 'Authorization: Bearer <key>' "
                "(or 'x-api-key: <key>')",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
