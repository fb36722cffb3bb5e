"""What every HTTP request passes before its route, and how its body is read.

In order: the `Host` check (403), the `Origin` check (403), a CORS preflight (answered here), the API key (401),
"engine not ready" (503), a POST's `Content-Type` (415) and declared size (413). Then the route runs with a
guarded `receive`: the body may not exceed the size limit (413, also for a chunked body without Content-Length)
and must arrive within the read deadline (408); a shutdown that cuts the server's grace period short answers a body still being read with a 503.
Every request is counted by endpoint and status code, and an exception no handler took is answered with a 500 in
OpenAI's shape without dropping the keep-alive connection.

Why the Host, Origin and Content-Type checks (loopback safety, as Ollama and Jupyter do it): without an API key,
any web page the local user visits could otherwise use the server. A page can POST to 127.0.0.1 without a CORS
preflight only with a "simple" Content-Type (text/plain, form encodings), so requiring application/json forces a
preflight, which fails (no CORS headers). A page that rebinds its own DNS name to 127.0.0.1 can read answers, but
its requests carry its own name in `Host`, which a loopback-bound server refuses. Browsers send `Origin` on
cross-origin requests; one that is not explicitly allowed is refused.

Why plain ASGI rather than a FastAPI dependency or BaseHTTPMiddleware: it must cover every route, the 404s of
routes that do not exist included, count the status a streaming response actually started with (or 499 when the
client left before any), and not buffer or wrap the streams themselves.

Every response carries `x-request-id` (refusals, 404s and streams included): the client's `X-Request-Id` when it
is 1 to 128 visible ASCII characters, else a fresh uuid4 hex; the route finds it in `request.state.request_id`.

CORS, only with --allowed-origins (otherwise every request with an Origin is refused, preflights included): a
preflight (`OPTIONS` with `Origin` and `Access-Control-Request-Method`) from an allowed origin is answered here
with 200, without the API key (browsers send none on a preflight) and whether the engine is ready or not; it
allows GET, POST and OPTIONS, the headers it asked for (by default Authorization and Content-Type), for
CORS_MAX_AGE_S seconds, and is not counted in the metrics. Every other response to an allowed origin gets
`Access-Control-Allow-Origin` (the origin itself and `Vary: Origin`, or `*` when any origin is allowed) and
exposes `x-request-id` to the page. Requests without an Origin get no CORS headers. The Host check still comes
first, so a DNS-rebinding page gets no preflight either.
"""
from __future__ import annotations

import asyncio
import hmac
import ipaddress
import logging
import re
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Dict, FrozenSet, Iterable, List, Optional, Tuple

from .errors import ENGINE_UNAVAILABLE, SERVER, APIError, error_response, server_shutdown

if TYPE_CHECKING:
    from .routes import ServerState

logger = logging.getLogger("minisrv.server")

OPEN_PATHS = ("/health",)  # answered without an API key (load balancers probe it)
DEFAULT_MAX_REQUEST_BYTES = 8 * 1024 * 1024
DEFAULT_REQUEST_READ_TIMEOUT_S = 30.0
JSON_MEDIA_TYPE = "application/json"
BODY_METHODS = ("POST", "PUT", "PATCH")  # requests whose Content-Type is checked
# routes outside /v1 that need the loaded engine or its tokenizer: 503 until it is ready, like /v1
ENGINE_PATHS = ("/tokenize", "/detokenize", "/tokenizer_info", "/get_model_info", "/flush_cache")
REQUEST_ID = b"x-request-id"
MAX_REQUEST_ID_CHARS = 128
CORS_METHODS = b"GET, POST, OPTIONS"
CORS_DEFAULT_HEADERS = b"Authorization, Content-Type"
CORS_MAX_AGE_S = 600
_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")  # an HTTP token (RFC 9110 section 5.6.2)
Headers = List[Tuple[bytes, bytes]]


# ---------------------------------------------------------------------------------------------- the policy
@dataclass(frozen=True)
class HostName:
    """A Host header or an --allowed-hosts entry: a lower-case name (IPv6 in brackets) and its port, if any."""

    name: str
    port: Optional[int] = None

    @classmethod
    def parse(cls, value: str) -> Optional["HostName"]:
        """`name`, `name:port`, `[v6]`, `[v6]:port` (and a bare IPv6 address); None if it is none of these."""
        v = value.strip().lower()
        if v.startswith("["):
            end = v.find("]")
            if end < 0:
                return None
            name, rest = v[:end + 1], v[end + 1:]
            if rest and not rest.startswith(":"):
                return None
            has_port, port = bool(rest), rest[1:]
        elif v.count(":") > 1:  # a bare IPv6 address (only in --allowed-hosts; a Host header brackets it)
            name, has_port, port = f"[{v}]", False, ""
        else:
            name, sep, port = v.partition(":")
            has_port = bool(sep)
        if has_port and not (port.isdigit() and int(port) < 65536):
            return None
        if not name.startswith("["):
            name = name.rstrip(".")  # "localhost." is "localhost"
        if not name or name == "[]":
            return None
        return cls(name, int(port) if has_port else None)

    def matches(self, other: "HostName") -> bool:
        """Does this allowed entry cover `other` (a request's Host)? An entry without a port covers every port."""
        return self.name == other.name and (self.port is None or self.port == other.port)


def is_loopback_name(host: HostName) -> bool:
    """localhost, an IPv4 address in 127.0.0.0/8, [::1] (or an IPv4-mapped loopback address)."""
    if host.name == "localhost":
        return True
    return _is_loopback_ip(host.name[1:-1] if host.name.startswith("[") else host.name)


def is_loopback_address(address: str) -> bool:
    """Is a bound address (or the name it was given by) a loopback one?"""
    if address.lower().rstrip(".") == "localhost":
        return True
    return _is_loopback_ip(address.split("%", 1)[0])


def _is_loopback_ip(text: str) -> bool:
    """An IP address literal in a loopback range (an IPv4-mapped IPv6 address by its IPv4 part); False for a
    text that is not an address."""
    try:
        addr = ipaddress.ip_address(text)
    except ValueError:
        return False
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return addr.ipv4_mapped.is_loopback
    return addr.is_loopback


def normalize_origin(value: str) -> str:
    """`scheme://host[:port]`, lower-case, without a trailing slash or the scheme's default port."""
    v = value.strip().lower().rstrip("/")
    for scheme, port in (("http://", ":80"), ("https://", ":443")):
        if v.startswith(scheme) and v.endswith(port):
            return v[:-len(port)]
    return v


def split_list(value: Optional[str]) -> List[str]:
    """A comma-separated flag value -> its non-empty items."""
    return [x.strip() for x in (value or "").split(",") if x.strip()]


@dataclass(frozen=True)
class HTTPPolicy:
    """Who may use the server, and how much a request may send.

    check_host: refuse a Host header that is neither a loopback name nor in `allowed_hosts` (on by default when
    the server is bound to a loopback address, see `for_bind`). allow_any_origin / allowed_origins: which
    `Origin` headers are accepted; by default none is (a request without one is not affected).
    """

    check_host: bool = False
    allowed_hosts: Tuple[HostName, ...] = ()
    allow_any_origin: bool = False
    allowed_origins: FrozenSet[str] = frozenset()
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    request_read_timeout: float = DEFAULT_REQUEST_READ_TIMEOUT_S

    @classmethod
    def for_bind(cls, bound_address: str, allowed_hosts: Iterable[str] = (), allowed_origins: Iterable[str] = (),
                 **limits: Any) -> "HTTPPolicy":
        """The policy of a server bound to `bound_address`: Host is checked when that address is a loopback one
        or --allowed-hosts names hosts; `*` in either list allows all. Raises ValueError on a malformed entry."""
        hosts, origins = list(allowed_hosts), list(allowed_origins)
        parsed = []
        for h in hosts:
            if h == "*":
                continue
            entry = HostName.parse(h)
            if entry is None:
                raise ValueError(f"--allowed-hosts: {h!r} is not a host name (NAME, NAME:PORT or [IPv6]:PORT)")
            parsed.append(entry)
        check_host = "*" not in hosts and (bool(hosts) or is_loopback_address(bound_address))
        return cls(check_host=check_host, allowed_hosts=tuple(parsed), allow_any_origin="*" in origins,
                   allowed_origins=frozenset(normalize_origin(o) for o in origins if o != "*"), **limits)

    def host_allowed(self, value: Optional[str]) -> bool:
        if not self.check_host or value is None:  # no Host at all (HTTP/1.0): not a browser
            return True
        host = HostName.parse(value)
        if host is None:
            return False
        return is_loopback_name(host) or any(entry.matches(host) for entry in self.allowed_hosts)

    def origin_allowed(self, value: Optional[str]) -> bool:
        return value is None or self.allow_any_origin or normalize_origin(value) in self.allowed_origins

    @property
    def cors(self) -> bool:
        """Are cross-origin requests served at all (--allowed-origins given)?"""
        return self.allow_any_origin or bool(self.allowed_origins)

    def cors_headers(self, origin: Optional[str]) -> Headers:
        """The CORS headers of a response to a request from `origin`: none without an Origin or CORS, or for an
        origin that is not allowed."""
        if origin is None or not self.cors or not self.origin_allowed(origin):
            return []
        expose = (b"access-control-expose-headers", REQUEST_ID)
        if self.allow_any_origin:
            return [(b"access-control-allow-origin", b"*"), expose]
        # the origin as the browser sent it (it compares the two exactly), not its normalized form
        return [(b"access-control-allow-origin", origin.strip().encode("latin-1")), (b"vary", b"Origin"), expose]


# ---------------------------------------------------------------------------------------------- the gate
def header(scope: Any, name: bytes) -> Optional[str]:
    for k, v in scope.get("headers", ()):
        if k == name:
            return v.decode("latin-1")
    return None


def header_values(scope: Any, name: bytes) -> List[str]:
    return [v.decode("latin-1") for k, v in scope.get("headers", ()) if k == name]


def is_json(content_type: Optional[str]) -> bool:
    """application/json, with or without parameters (charset=utf-8, ...)."""
    return content_type is not None and content_type.split(";", 1)[0].strip().lower() == JSON_MEDIA_TYPE


def declared_length(scope: Any) -> Optional[int]:
    value = header(scope, b"content-length")
    if value is None:
        return None
    try:
        return int(value.strip())
    except ValueError:
        return None


def has_body(scope: Any) -> bool:
    return bool(declared_length(scope)) or header(scope, b"transfer-encoding") is not None


def request_id(scope: Any) -> str:
    """The client's X-Request-Id if it is 1..MAX_REQUEST_ID_CHARS visible ASCII characters, else a fresh id."""
    value = header(scope, REQUEST_ID)
    if value is not None:
        value = value.strip()
        if 0 < len(value) <= MAX_REQUEST_ID_CHARS and all("!" <= c <= "~" for c in value):
            return value
    return uuid.uuid4().hex


def is_preflight(scope: Any) -> bool:
    return (scope.get("method") == "OPTIONS" and header(scope, b"origin") is not None
            and header(scope, b"access-control-request-method") is not None)


def requested_headers(scope: Any) -> bytes:
    """Access-Control-Request-Headers' names (valid ones only), or the default pair when it asks for none."""
    names = [n.strip() for v in header_values(scope, b"access-control-request-headers") for n in v.split(",")]
    names = [n for n in names if _HEADER_NAME.fullmatch(n)]
    return ", ".join(names).encode("latin-1") if names else CORS_DEFAULT_HEADERS


def with_headers(send: Callable, extra: Headers) -> Callable:
    """`send`, adding `extra` to the response's headers."""
    async def send_with_headers(msg: Dict[str, Any]) -> None:
        if msg["type"] == "http.response.start":
            msg = {**msg, "headers": [*msg.get("headers", ()), *extra]}
        await send(msg)

    return send_with_headers


def too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than this server's limit of {limit} bytes",
                    code="request_too_large", close=True)


class Gate:
    def __init__(self, app: Any, state: "ServerState") -> None:
        self.app, self.state = app, state

    def refusal(self, scope: Any) -> Optional[APIError]:
        """Why this request is answered before its route, if it is."""
        return self.site_refusal(scope) or self.request_refusal(scope)

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
            return APIError(401, "Invalid or missing API key: send 'Authorization: Bearer <key>'.",
                            code="invalid_api_key")
        if not self.state.ready and (path.startswith("/v1/") or path in ENGINE_PATHS):
            return APIError(503, "the engine is not ready (still loading, or stopped)", SERVER,
                            code=ENGINE_UNAVAILABLE)
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
        send = with_headers(send, extra)
        if refused is not None:
            if has_body(scope):
                refused.close = True  # the body is not read: the connection cannot be reused
            await refused.response()(scope, receive, send)
            metrics.count_http(path, refused.status)
            return
        status = {"code": 499}  # until a response starts: the client left first

        async def send_and_note(msg: Dict[str, Any]) -> None:
            if msg["type"] == "http.response.start":
                status["code"] = msg["status"]
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
            await error_response(500, "internal server error", SERVER)(scope, receive, send)
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


class GuardedBody:
    """The `receive` a route gets: while the request body is being read, at most `limit` bytes of it (413), all
    of it within `timeout` seconds of the request's start (408), and a 503 if the server stops meanwhile. Once the
    body is complete it is `receive` itself (disconnect watchers wait on it, untimed)."""

    def __init__(self, receive: Callable, state: "ServerState", limit: int, timeout: float) -> None:
        self.receive, self.state, self.limit = receive, state, limit
        self.loop = asyncio.get_running_loop()
        self.deadline = self.loop.time() + timeout
        self.timeout = timeout
        self.received = 0
        self.complete = False

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


def authorized(scope: Any, key: str) -> bool:
    """`Authorization: Bearer <key>`, compared in constant time."""
    value = header(scope, b"authorization")
    if value is None:
        return False
    scheme, _, token = value.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())
