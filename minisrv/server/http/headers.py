"""Reading an ASGI request's headers: one header, the declared body, the request id, the API key, a CORS
preflight's asks; and adding headers to a response as it is sent."""
from __future__ import annotations

import hmac
import re
import uuid
from typing import Any, Callable, Dict, List, Optional

from .policy import REQUEST_ID, Headers

JSON_MEDIA_TYPE = "application/json"
MAX_REQUEST_ID_CHARS = 128
CORS_DEFAULT_HEADERS = b"Authorization, Content-Type"
_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")  # an HTTP token (RFC 9110 section 5.6.2)


def header(scope: Any, name: bytes) -> Optional[str]:
    return next((v.decode("latin-1") for k, v in scope.get("headers", ()) if k == name), None)


def header_values(scope: Any, name: bytes) -> List[str]:
    return [v.decode("latin-1") for k, v in scope.get("headers", ()) if k == name]


def is_json(content_type: Optional[str]) -> bool:
    """application/json, with or without parameters (charset=utf-8, ...)."""
    return content_type is not None and content_type.split(";", 1)[0].strip().lower() == JSON_MEDIA_TYPE


def declared_length(scope: Any) -> Optional[int]:
    try:
        return int((header(scope, b"content-length") or "").strip())
    except ValueError:  # none, or not a number
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
    async def send_with_headers(msg: Dict[str, Any]) -> None:
        if msg["type"] == "http.response.start":
            msg = {**msg, "headers": [*msg.get("headers", ()), *extra]}
        await send(msg)

    return send_with_headers


def authorized(scope: Any, key: str) -> bool:
    """`Authorization: Bearer <key>`, or `x-api-key: <key>` (Anthropic's clients), compared in constant time."""
    value = header(scope, b"authorization")
    if value is not None:
        scheme, _, token = value.partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode()):
            return True
    value = header(scope, b"x-api-key")
    return value is not None and hmac.compare_digest(value.strip().encode(), key.encode())
