"""What every HTTP request passes before its route, and how its body is read.

In order: the `Host` check (403), the `Origin` check (403), a CORS preflight (answered here), the API key (401),
"engine not ready" (503), a POST's `Content-Type` (415) and declared size (413). The route then reads a guarded
body: at most the size limit (413, chunked bodies too), within the read deadline (408), a 503 if the shutdown cuts
it short. Every request is counted by endpoint and status, and an exception no handler took is a 500 in the API's
error shape without dropping the keep-alive connection. Every response carries `x-request-id`: the client's
`X-Request-Id` when it is 1 to 128 visible ASCII characters, else a fresh one (`request.state.request_id`).

Why plain ASGI rather than a FastAPI dependency or BaseHTTPMiddleware: it must cover every route (404s included),
count the status a stream actually started with (or 499), and not buffer or wrap the streams."""
from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any, Callable, Collection, Dict, Optional

from ..errors import SERVER, APIError, engine_unavailable, server_shutdown
from .headers import (JSON_MEDIA_TYPE, authorized, declared_length, has_body, header, header_values, is_json,
                      is_preflight, request_id, requested_headers, with_headers)
from .policy import REQUEST_ID, Headers, HTTPPolicy

if TYPE_CHECKING:
    from ..state import ServerState

logger = logging.getLogger("minisrv.server")

OPEN_PATHS = ("/health",)  # answered without an API key (load balancers probe it)
BODY_METHODS = ("POST", "PUT", "PATCH")  # requests whose Content-Type is checked
CORS_METHODS = b"GET, POST, OPTIONS"
CORS_MAX_AGE_S = 600


class Gate:
    """`engine_paths`: routes outside /v1 that need the loaded engine or its tokenizer (503 until it is ready)."""

    def __init__(self, app: Any, state: "ServerState", engine_paths: Collection[str]) -> None:
        self.app, self.state, self.engine_paths = app, state, engine_paths

    def site_refusal(self, scope: Any) -> Optional[APIError]:
        """Whether the request's Host and Origin are refused (a 403)."""
        policy: HTTPPolicy = self.state.http
        hosts = header_values(scope, b"host")
        if not all(policy.host_allowed(h) for h in hosts):
            return APIError(403, f"Host {hosts[0]!r} is not allowed: this server answers to its loopback names "
                                 "(see --allowed-hosts)", code="host_not_allowed")
        origins = header_values(scope, b"origin")
        if not all(policy.origin_allowed(o) for o in origins):
            return APIError(403, f"Origin {origins[0]!r} is not allowed (see --allowed-origins)",
                            code="origin_not_allowed")
        return None

    def request_refusal(self, scope: Any) -> Optional[APIError]:
        """The checks after Host and Origin: API key, readiness, Content-Type, declared size."""
        policy: HTTPPolicy = self.state.http
        path = scope.get("path", "")
        key = self.state.api_key
        if key and path not in OPEN_PATHS and not authorized(scope, key):
            return APIError(401, "Invalid or missing API key: send 'Authorization: Bearer <key>' (or 'x-api-key: "
                                 "<key>').", code="invalid_api_key")
        if not self.state.ready and (path.startswith("/v1/") or path in self.engine_paths):
            return engine_unavailable()
        if scope.get("method") in BODY_METHODS:
            ctype = header(scope, b"content-type")
            if not is_json(ctype):
                return APIError(415, f"Content-Type must be {JSON_MEDIA_TYPE}, got {ctype or 'none'!r}",
                                code="unsupported_media_type")
            length = declared_length(scope)
            if length is not None and length > policy.max_request_bytes:
                return too_large(policy.max_request_bytes)
        return None

    async def __call__(self, scope: Any, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        metrics = self.state.metrics
        policy: HTTPPolicy = self.state.http
        rid = request_id(scope)
        scope.setdefault("state", {})["request_id"] = rid  # request.state.request_id
        extra: Headers = [(REQUEST_ID, rid.encode("ascii"))]
        refused = self.site_refusal(scope)
        if refused is None:
            extra += policy.cors_headers(header(scope, b"origin"))
            if policy.cors and is_preflight(scope):
                return await self.preflight(scope, receive, with_headers(send, extra))
            refused = self.request_refusal(scope)
        if refused is not None:
            if has_body(scope):
                refused.close = True  # the body is not read: the connection cannot be reused
            await refused.response(path)(scope, receive, with_headers(send, extra))
            metrics.count_http(path, refused.status)
            return
        status = {"code": 499}  # until a response starts: the client left first

        async def send_and_note(msg: Dict[str, Any]) -> None:
            """with_headers' send, noting the status (one wrapper: a stream sends through it every token)."""
            if msg["type"] == "http.response.start":
                status["code"] = msg["status"]
                msg = {**msg, "headers": [*msg.get("headers", ()), *extra]}
            await send(msg)

        body = GuardedBody(receive, self.state, policy.max_request_bytes, policy.request_read_timeout)
        try:
            await self.app(scope, body, send_and_note)
        except asyncio.CancelledError:
            if not self.state.stopping:
                raise
            # the shutdown's last resort after its grace period: nothing is left to answer this client with
            logger.warning("%s: cut off by the shutdown", path)
        except Exception:  # noqa: BLE001 - a bug: answered in OpenAI's shape, the connection stays usable
            logger.exception("unhandled error on %s", path)
            if status["code"] != 499:
                raise  # the response has begun: nothing else can be said on it
            status["code"] = 500
            await APIError(500, "internal server error", SERVER).response(path)(scope, receive, send_and_note)
        finally:
            metrics.count_http(path, status["code"])

    @staticmethod
    async def preflight(scope: Any, receive: Callable, send: Callable) -> None:
        """200 to a CORS preflight from an allowed origin (`send` adds Allow-Origin and x-request-id)."""
        headers: Headers = [(b"access-control-allow-methods", CORS_METHODS),
                            (b"access-control-allow-headers", requested_headers(scope)),
                            (b"access-control-max-age", str(CORS_MAX_AGE_S).encode()),
                            (b"vary", b"Access-Control-Request-Headers"),
                            (b"content-length", b"0")]
        if has_body(scope):
            headers.append((b"connection", b"close"))  # the body is not read
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": b""})


def too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than this server's limit of {limit} bytes",
                    code="request_too_large", close=True)


class GuardedBody:
    """The `receive` a route gets, guarding the body's reads (see the module docstring); then `receive` itself."""

    def __init__(self, receive: Callable, state: "ServerState", limit: int, timeout: float) -> None:
        self.receive, self.state, self.limit, self.timeout = receive, state, limit, timeout
        self.loop = asyncio.get_running_loop()
        self.deadline = self.loop.time() + timeout
        self.received, self.complete = 0, False

    async def __call__(self) -> Dict[str, Any]:
        if self.complete:
            return await self.receive()
        if self.state.stopping:
            raise server_shutdown(close=True)
        remaining = self.deadline - self.loop.time()
        if remaining <= 0:
            raise self.timed_out()
        part = asyncio.ensure_future(self.receive())
        stop = self.loop.create_future()

        def on_stop() -> None:
            if not stop.done():
                stop.set_result(None)

        self.state.on_stop.add(on_stop)
        try:
            done, _ = await asyncio.wait({part, stop}, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
        finally:
            self.state.on_stop.discard(on_stop)
            stop.cancel()
            if not part.done():
                part.cancel()
        if part not in done:
            raise server_shutdown(close=True) if stop in done else self.timed_out()
        msg = part.result()
        if msg["type"] == "http.request":
            self.received += len(msg.get("body", b""))
            if self.received > self.limit:
                raise too_large(self.limit)
            self.complete = not msg.get("more_body", False)
        else:  # http.disconnect
            self.complete = True
        return msg

    def timed_out(self) -> APIError:
        return APIError(408, f"the request body did not arrive within {self.timeout:g} seconds",
                        code="request_timeout", close=True)
