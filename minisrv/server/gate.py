"""What every HTTP request passes before its route: the API-key check, the "engine not ready" answer, and the
request counter by endpoint and status code.

Why plain ASGI rather than a FastAPI dependency or BaseHTTPMiddleware: it must cover every route, the 404s of
routes that do not exist included, count the status a streaming response actually started with (or 499 when the
client left before any), and not buffer or wrap the streams themselves.
"""
from __future__ import annotations

import hmac
from typing import TYPE_CHECKING, Any, Callable, Dict

from .errors import ENGINE_UNAVAILABLE, SERVER, error_response

if TYPE_CHECKING:
    from .routes import ServerState

OPEN_PATHS = ("/health",)  # answered without an API key (load balancers probe it)


class Gate:
    def __init__(self, app: Any, state: "ServerState") -> None:
        self.app, self.state = app, state

    async def __call__(self, scope: Any, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        metrics = self.state.metrics
        key = self.state.api_key
        if key and path not in OPEN_PATHS and not authorized(scope, key):
            resp = error_response(401, "Invalid or missing API key: send 'Authorization: Bearer <key>'.",
                                  code="invalid_api_key")
            await resp(scope, receive, send)
            metrics.count_http(path, 401)
            return
        if not self.state.ready and path.startswith("/v1/"):
            resp = error_response(503, "the engine is not ready (still loading, or stopped)", SERVER,
                                  code=ENGINE_UNAVAILABLE)
            await resp(scope, receive, send)
            metrics.count_http(path, 503)
            return
        status = {"code": 499}  # until a response starts: the client left first

        async def send_and_note(msg: Dict[str, Any]) -> None:
            if msg["type"] == "http.response.start":
                status["code"] = msg["status"]
            await send(msg)

        try:
            await self.app(scope, receive, send_and_note)
        except Exception:
            status["code"] = 500
            raise
        finally:
            metrics.count_http(path, status["code"])


def authorized(scope: Any, key: str) -> bool:
    """`Authorization: Bearer <key>`, compared in constant time."""
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())
    return False
