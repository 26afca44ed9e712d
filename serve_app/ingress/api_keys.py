"""API keys: with `ServerConfig.apiKeys` (or SERVE_APP_API_KEYS) set, every request but the
health and metrics routes needs `Authorization: Bearer <key>`; others get 401 in their API
family's error shape, with `WWW-Authenticate: Bearer` (docs/apis.md#api-keys).

An ASGI middleware outside the body reader, so a request without a key costs no body read.
Keys are compared in constant time (each against every configured key, no early exit) and never
logged: the config holds them as SecretStr, and nothing here prints a header.
"""

from __future__ import annotations

import hmac
import re

from serve_app.ingress.request_body import ASGIApp, Receive, Scope, Send, error_response
from serve_app.messages import ErrorKind
from serve_app.protocol.errors import APIError

# Probes and scrapers, which carry no key: liveness/readiness, Prometheus, and the
# databricks-sdk's discovery probe (it sends no token; a 401 there only makes it warn).
OPEN_PATHS = frozenset(
    {"/health", "/v2/health/live", "/v2/health/ready", "/metrics",
     "/.well-known/databricks-config"}
)  # fmt: skip
_MODEL_READY = re.compile(r"^/v2/models/[^/]+(/versions/[^/]+)?/ready$")


class ApiKeys:
    def __init__(self, app: ASGIApp, keys: list[str]) -> None:
        self.app = app
        self.keys = [key.encode("utf-8") for key in keys]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or path in OPEN_PATHS or _MODEL_READY.match(path):
            await self.app(scope, receive, send)
            return
        if self._allowed(_bearer(scope)):
            await self.app(scope, receive, send)
            return
        error = APIError(
            ErrorKind.UNAUTHORIZED,
            "a valid API key is required: send the header 'Authorization: Bearer <key>'",
        )
        response = error_response(error, path)
        response.headers["WWW-Authenticate"] = "Bearer"
        await response(scope, receive, send)

    def _allowed(self, token: bytes | None) -> bool:
        if token is None:
            return False
        found = False
        for key in self.keys:  # every key compared: the time does not tell which one matched
            found |= hmac.compare_digest(token, key)
        return found


def _bearer(scope: Scope) -> bytes | None:
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            scheme, _, token = value.partition(b" ")
            if scheme.lower() == b"bearer" and token.strip():
                return token.strip()
            return None
    return None
