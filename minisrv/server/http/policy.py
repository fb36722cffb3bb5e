"""Who may use the server and how much a request may send: the Host and Origin rules, CORS, the body limits.

Why the Host, Origin and Content-Type checks (loopback safety, as Ollama and Jupyter do it): without an API key, any
web page the local user visits could otherwise use the server. A page can POST without a CORS preflight only with a
"simple" Content-Type, so requiring application/json forces a preflight, which fails; a page that rebinds its DNS
name to 127.0.0.1 sends its own name in `Host`, which a loopback-bound server refuses; a cross-origin `Origin` that
is not explicitly allowed is refused.

CORS, only with --allowed-origins: a preflight from an allowed origin is answered 200 (without the API key, ready or
not; GET, POST, OPTIONS and the asked headers, for CORS_MAX_AGE_S seconds; not counted in the metrics), and every
other response to it gets `Access-Control-Allow-Origin` (the origin with `Vary: Origin`, or `*`) and exposes
`x-request-id`. The Host check still comes first, so a DNS-rebinding page gets no preflight either."""
from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Any, FrozenSet, Iterable, List, Optional, Tuple

DEFAULT_MAX_REQUEST_BYTES = 8 * 1024 * 1024
DEFAULT_REQUEST_READ_TIMEOUT_S = 30.0
REQUEST_ID = b"x-request-id"
Headers = List[Tuple[bytes, bytes]]


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


def is_loopback_address(address: str) -> bool:
    """Is a bound address, a Host's name (IPv6 unbracketed) or the name either was given by a loopback one:
    localhost, an IPv4 address in 127.0.0.0/8, ::1 (an IPv4-mapped IPv6 address by its IPv4 part)?"""
    if address.lower().rstrip(".") == "localhost":
        return True
    try:
        addr = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return False
    mapped = addr.ipv4_mapped if isinstance(addr, ipaddress.IPv6Address) else None
    return (mapped or addr).is_loopback


def normalize_origin(value: str) -> str:
    """`scheme://host[:port]`, lower-case, without a trailing slash or the scheme's default port."""
    v = value.strip().lower().rstrip("/")
    for scheme, port in (("http://", ":80"), ("https://", ":443")):
        if v.startswith(scheme) and v.endswith(port):
            return v[:-len(port)]
    return v


def split_list(value: Optional[str]) -> List[str]:
    return [x.strip() for x in (value or "").split(",") if x.strip()]


@dataclass(frozen=True)
class HTTPPolicy:
    """Who may use the server, and how much a request may send: `check_host` refuses a Host that is neither a loopback
name nor allowed (see `for_bind`); `Origin` is accepted only as allowed (a request without one is not affected)."""

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
        return is_loopback_address(host.name.strip("[]")) or any(entry.matches(host) for entry in self.allowed_hosts)

    def origin_allowed(self, value: Optional[str]) -> bool:
        return value is None or self.allow_any_origin or normalize_origin(value) in self.allowed_origins

    @property
    def cors(self) -> bool:
        """Are cross-origin requests served at all (--allowed-origins given)?"""
        return self.allow_any_origin or bool(self.allowed_origins)

    def cors_headers(self, origin: Optional[str]) -> Headers:
        """The CORS headers of a response to a request from `origin` (none unless it is an allowed one)."""
        if origin is None or not self.cors or not self.origin_allowed(origin):
            return []
        expose = (b"access-control-expose-headers", REQUEST_ID)
        if self.allow_any_origin:
            return [(b"access-control-allow-origin", b"*"), expose]
        # the origin as the browser sent it (it compares the two exactly), not its normalized form
        return [(b"access-control-allow-origin", origin.strip().encode("latin-1")), (b"vary", b"Origin"), expose]
