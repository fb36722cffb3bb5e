"""Requests written on raw sockets (half-sent heads, bodies larger than announced, chunked bodies) and checks of
the answers, for the tests of the HTTP layer; and the limits of the server those tests share (`hardened_server`
in conftest.py)."""
from __future__ import annotations

import json
import select
import socket
from typing import Optional, Tuple

import pytest

httpx = pytest.importorskip("httpx")

READ_TIMEOUT_S = 2  # the shared server's --request-read-timeout
POOL_TOKENS = 2048  # the shared server's --max-total-tokens: requests are limited to this, not to the context
HARDENED_SERVER_ARGS = ("--max-total-tokens", str(POOL_TOKENS), "--request-read-timeout", str(READ_TIMEOUT_S),
                        "--allowed-hosts", "myhost.test,other.test:8080", "--allowed-origins", "http://good.example")
MAX_BYTES = 8 * 1024 * 1024  # the default --max-request-bytes
JSON_HEADERS = {"Content-Type": "application/json"}


def raw_request(port: int, head: bytes, body: bytes = b"", timeout: float = 30.0) -> Tuple[int, bytes, bytes]:
    """One request written on a fresh socket; (status, head, body) of the answer, read until the server closes
    the connection or the body announced by Content-Length is complete."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(head)
        if body:
            s.sendall(body)
        return read_response(s)


def read_response(s: socket.socket) -> Tuple[int, bytes, bytes]:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        if not chunk:
            raise ConnectionError(f"closed before a response head: {data!r}")
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), None)
    while length is None or len(body) < length:
        chunk = s.recv(65536)
        if not chunk:
            break
        body += chunk
    return int(head.split(b" ", 2)[1]), head, body


def post_head(path: str, length: Optional[int], content_type: str = "application/json", host: str = "127.0.0.1",
              extra: str = "") -> bytes:
    size = f"Content-Length: {length}\r\n" if length is not None else "Transfer-Encoding: chunked\r\n"
    return (f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: {content_type}\r\n{size}{extra}\r\n").encode()


def send_chunked_until_answered(port: int, body: bytes, chunk: int = 1 << 16) -> Tuple[int, bytes, bytes]:
    """POST `body` with chunked transfer encoding, a chunk at a time, stopping as soon as an answer arrives."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(post_head("/v1/completions", None))
        for i in range(0, len(body), chunk):
            if select.select([s], [], [], 0)[0]:
                break
            part = body[i:i + chunk]
            try:
                s.sendall(b"%x\r\n" % len(part) + part + b"\r\n")
            except OSError:
                break
        else:
            s.sendall(b"0\r\n\r\n")
        return read_response(s)


def assert_openai_error(body: bytes, code: Optional[str] = None, type_: str = "invalid_request_error") -> dict:
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    assert err["type"] == type_, err
    if code is not None:
        assert err["code"] == code, err
    return err


def local_port(r: httpx.Response) -> int:
    """The client-side port the response came on: equal for two responses on one kept-alive connection."""
    return r.extensions["network_stream"].get_extra_info("client_addr")[1]
