"""No request can take the server down, stall it, or use it from a web page: real servers on loopback ports.

One module-scoped server with small limits serves most checks (cross-site refusals, the enforced length limit in
/v1/models, strict JSON on a kept-alive connection, body size and read-time limits, the choices cap, /health under
stall loads); a second one is stopped with SIGTERM while streams are open. Requests that must be malformed on the
wire (half-sent heads, bodies larger than announced, chunked bodies) are written on raw sockets. The parsing of
large bodies in pieces and the Host/Origin policy are also checked in-process against json.loads and by hand.
"""
from __future__ import annotations

import http.client
import json
import random
import select
import signal
import socket
import threading
import time
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import httpx
import pytest

from .helpers.server_process import Server, children as _children, gone as _gone

pytestmark = pytest.mark.slow  # starts server processes

READ_TIMEOUT_S = 2  # the module server's --request-read-timeout
POOL_TOKENS = 2048  # the module server's --max-total-tokens: requests are limited to this, not to the context
HEALTH_MAX_S = 0.100  # /health must answer within this under every load below
MAX_BYTES = 8 * 1024 * 1024  # the default --max-request-bytes
JSON_HEADERS = {"Content-Type": "application/json"}


# ---------------------------------------------------------------------------------------------- helpers
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


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    s = Server("--max-total-tokens", str(POOL_TOKENS), "--request-read-timeout", str(READ_TIMEOUT_S),
               "--allowed-hosts", "myhost.test,other.test:8080", "--allowed-origins", "http://good.example")
    try:
        s.wait_ready()
        yield s
    finally:
        s.proc.send_signal(signal.SIGTERM)
        try:
            code = s.proc.wait(60)
        finally:
            s.kill()
    assert code == 0, "".join(s.lines)


# ---------------------------------------------------------------------------------------------- 1. cross-site use
def test_cross_site_requests_are_refused(server: Server) -> None:
    """What a web page can send without a CORS preflight (text/plain, form encodings), a foreign Host (DNS
    rebinding) and a foreign Origin are refused in OpenAI's error shape; JSON from a loopback name is served."""
    body = json.dumps({"prompt": "Hi", "max_tokens": 1}).encode()
    url = server.url + "/v1/completions"
    for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                  "application/jsonx", None):
        headers = {"Content-Type": ctype} if ctype else {}
        r = httpx.post(url, content=body, headers=headers, timeout=30)
        assert r.status_code == 415, (ctype, r.text)
        assert_openai_error(r.content, "unsupported_media_type")
    # the page's own name in Host: refused on every route, /health and unknown ones included
    for method, path in (("POST", "/v1/completions"), ("GET", "/v1/models"), ("GET", "/health"),
                         ("GET", "/metrics"), ("GET", "/nothing")):
        for host in ("evil.example", "evil.example:%d" % server.port, "127.0.0.1.evil.example", "localhost.evil",
                     "myhost.test.evil", "other.test:9090"):
            r = httpx.request(method, server.url + path, content=body if method == "POST" else None,
                              headers={**JSON_HEADERS, "Host": host}, timeout=30)
            assert r.status_code == 403, (method, path, host, r.text)
            assert_openai_error(r.content, "host_not_allowed")
    for host in ("localhost", "LOCALHOST:1234", "127.0.0.1", "127.8.9.10:30000", "[::1]", "[::1]:80", "myhost.test",
                 "myhost.test:1", "other.test:8080"):
        r = httpx.get(server.url + "/health", headers={"Host": host}, timeout=30)
        assert r.status_code == 200, (host, r.text)
    # an Origin header: refused unless --allowed-origins names it
    for origin in ("http://evil.example", "null", "http://127.0.0.1:%d" % server.port, "https://good.example"):
        r = httpx.post(url, content=body, headers={**JSON_HEADERS, "Origin": origin}, timeout=30)
        assert r.status_code == 403, (origin, r.text)
        assert_openai_error(r.content, "origin_not_allowed")
        assert "access-control-allow-origin" not in r.headers
    r = httpx.post(url, content=body, headers={**JSON_HEADERS, "Origin": "http://good.example"}, timeout=60)
    assert r.status_code == 200, r.text
    # application/json with parameters is JSON
    r = httpx.post(url, content=body, headers={"Content-Type": "Application/JSON; charset=utf-8"}, timeout=60)
    assert r.status_code == 200, r.text


# ---------------------------------------------------------------------------------------------- 5. /v1/models
def test_models_reports_the_enforced_limit(server: Server) -> None:
    """max_model_len is the limit requests are held to (the 2,048-token pool), not the 8,192-token context."""
    card = httpx.get(server.url + "/v1/models", timeout=30).json()["data"][0]
    assert card["max_model_len"] == POOL_TOKENS
    one = httpx.get(server.url + "/v1/models/" + card["id"], timeout=30).json()
    assert one["max_model_len"] == POOL_TOKENS
    prompt = [1, 2, 3, 4]
    r = httpx.post(server.url + "/v1/completions", timeout=30,
                   json={"prompt": prompt, "max_tokens": card["max_model_len"] - len(prompt) + 1})
    assert r.status_code == 400
    err = assert_openai_error(r.content, "context_length_exceeded")
    assert str(POOL_TOKENS) in err["message"]


# ---------------------------------------------------------------------------------------------- 3. strict JSON
def _deep(depth: int) -> bytes:
    """A completion request whose ignored field `x` makes the body `depth` levels deep in all."""
    return b'{"prompt": "Hi", "max_tokens": 1, "x": ' + b"[" * (depth - 1) + b"]" * (depth - 1) + b"}"


BAD_JSON = [
    (b"[" * 10000 + b"]" * 10000, "nests too deeply"),
    (b'{"prompt": ' + b"[" * 10000 + b"]" * 10000 + b"}", "nests too deeply"),
    (_deep(65), "nests too deeply"),
    (b'{"prompt": "Hi", "max_tokens": 1, "x": NaN}', "NaN"),
    (b'{"prompt": "Hi", "max_tokens": 1, "x": Infinity}', "Infinity"),
    (b'{"prompt": "Hi", "max_tokens": 1, "x": -Infinity}', "-Infinity"),
    (b'{"prompt": "Hi", "max_tokens": 1, "temperature": 1e999}', "out of range"),
    (b'{"prompt": "\\ud800 lone surrogate", "max_tokens": 1}', "surrogate"),
    (b'{"prompt": "Hi", "max_tokens": 1, "x": "\\udc00"}', "surrogate"),
    (b'{"prompt": "\xff\xfe"}', "UTF-8"),
    (b'{"prompt": "Hi",}', "not valid JSON"),
]


def test_bad_json_is_a_400_and_the_connection_stays_usable(server: Server) -> None:
    """Deep nesting (a 500 and a dropped connection before), NaN/Infinity literals, overflowing numbers, lone
    surrogates and invalid UTF-8 are each a 400 in OpenAI's shape, and the same kept-alive connection then
    serves a good request. 64 levels are fine, 65 are not."""
    with httpx.Client(base_url=server.url, timeout=60, headers=JSON_HEADERS) as h:
        first = h.post("/v1/completions", content=_deep(64))
        assert first.status_code == 200, first.text
        port = local_port(first)
        for body, words in BAD_JSON:
            for path in ("/v1/completions", "/v1/chat/completions"):
                r = h.post(path, content=body)
                assert r.status_code == 400, (body[:60], r.text)
                assert words in assert_openai_error(r.content)["message"], (body[:60], r.text)
                assert local_port(r) == port, "the connection was dropped after an error"
                good = h.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
                assert good.status_code == 200 and local_port(good) == port


@pytest.mark.parametrize("head", [b"NOT HTTP AT ALL\r\n\r\n", b"GET /health HTTP/1.1\r\nHost 127.0.0.1\r\n\r\n",
                                  b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: x\r\n\r\n"],
                         ids=["request-line", "header-without-colon", "content-length-not-a-number"])
def test_unparsable_requests_are_a_400_in_the_error_shape(server: Server, head: bytes) -> None:
    """A request the HTTP parser rejects is answered like every other error: OpenAI's shape, an x-request-id."""
    status, resp_head, body = raw_request(server.port, head)
    assert status == 400, (resp_head, body)
    assert_openai_error(body)
    headers = dict(line.split(b": ", 1) for line in resp_head.split(b"\r\n")[1:])
    assert len(headers[b"x-request-id"]) == 32 and headers[b"content-type"] == b"application/json", resp_head


# ---------------------------------------------------------------------------------------------- 2. stalls
def _many_prompts_body() -> bytes:
    body = json.dumps({"prompt": ["hello there"] * 50000, "max_tokens": 1}).encode()
    assert len(body) > 500_000
    return body


def _huge_body() -> bytes:
    return json.dumps({"prompt": "x" * (20 * 1024 * 1024), "max_tokens": 1}).encode()


def test_choices_are_capped(server: Server) -> None:
    """Prompts x n is at most 256 per request: 50,000 prompts in 0.5 MB are refused at once, before tokenizing."""
    t = time.perf_counter()
    status, _, body = raw_request(server.port, post_head("/v1/completions", len(_many_prompts_body())),
                                  _many_prompts_body())
    assert status == 400 and time.perf_counter() - t < 2.0
    err = assert_openai_error(body)
    assert err["param"] == "prompt" and "256" in err["message"]
    r = httpx.post(server.url + "/v1/completions", json={"prompt": ["a", "b", "c"], "n": 100}, timeout=30)
    assert r.status_code == 400 and assert_openai_error(r.content)["param"] == "n"
    r = httpx.post(server.url + "/v1/completions", json={"prompt": ["a", "b"], "n": 128, "max_tokens": 1},
                   timeout=120)
    assert r.status_code == 200 and len(r.json()["choices"]) == 256


def test_body_size_limit(server: Server) -> None:
    """A body over 8 MiB is a 413 in OpenAI's shape: at once from its Content-Length (before it is read), and for
    a chunked body as soon as 8 MiB have arrived; the connection is closed. A long prompt whose characters prove
    it too long is refused before tokenizing."""
    huge = _huge_body()
    t = time.perf_counter()
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
        s.sendall(post_head("/v1/completions", len(huge)) + huge[:65536])  # the rest is never sent
        status, head, body = read_response(s)
        assert status == 413 and b"connection: close" in head.lower()
        try:
            assert s.recv(1) == b""  # closed
        except ConnectionResetError:  # closed with our unread bytes still queued
            pass
    assert time.perf_counter() - t < 2.0
    assert_openai_error(body, "request_too_large")
    t = time.perf_counter()
    status, head, body = send_chunked_until_answered(server.port, huge)
    assert status == 413 and b"connection: close" in head.lower()
    assert_openai_error(body, "request_too_large")
    assert time.perf_counter() - t < 10.0
    # just under the limit is read, and a prompt of 4 million characters is refused without tokenizing it
    long_prompt = json.dumps({"prompt": "hello world " * 350_000, "max_tokens": 1}).encode()
    assert len(long_prompt) < MAX_BYTES
    t = time.perf_counter()
    status, _, body = raw_request(server.port, post_head("/v1/completions", len(long_prompt)), long_prompt)
    assert status == 400 and time.perf_counter() - t < 2.0, body
    assert assert_openai_error(body, "context_length_exceeded")["param"] == "prompt"


def _health_worst_under(url: str, load: Callable[[], None], seconds: float = 1.5) -> Tuple[float, int, int]:
    """Run `load` over and over in a thread for `seconds`, timing /health from another connection meanwhile;
    (worst /health time, /health answers, loads completed)."""
    stop = threading.Event()
    done = [0]

    def run() -> None:
        while not stop.is_set():
            try:
                load()
            except OSError:
                pass
            done[0] += 1

    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    conn.request("GET", "/health")
    assert conn.getresponse().read() == b'{"status":"ok"}'
    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worst, n = 0.0, 0
    end = time.monotonic() + seconds
    try:
        while time.monotonic() < end or done[0] == 0:
            t = time.perf_counter()
            conn.request("GET", "/health")
            r = conn.getresponse()
            r.read()
            worst = max(worst, time.perf_counter() - t)
            n += 1
            assert r.status == 200
            time.sleep(0.01)
    finally:
        stop.set()
        worker.join(60)
        conn.close()
    return worst, n, done[0]


def test_health_answers_fast_under_stall_loads(server: Server) -> None:
    """/health answers within 100 ms from another connection while the server handles, over and over: a 0.5 MB
    body of 50,000 prompts, a 20 MB body (with Content-Length, and chunked), a 4-million-character prompt, and a
    7 MB body of 100,000+ empty arrays."""
    many, huge = _many_prompts_body(), _huge_body()
    long_prompt = json.dumps({"prompt": "hello world " * 350_000, "max_tokens": 1}).encode()
    arrays = b'{"prompt": "Hi", "x": [' + b",".join([b"[]"] * 2_400_000) + b"]}"
    loads: Dict[str, Callable[[], None]] = {
        "50,000 prompts": lambda: raw_request(server.port, post_head("/v1/completions", len(many)), many),
        "20 MB": lambda: raw_request(server.port, post_head("/v1/completions", len(huge)), huge),
        "20 MB chunked": lambda: send_chunked_until_answered(server.port, huge),
        "4M-character prompt": lambda: raw_request(server.port, post_head("/v1/completions", len(long_prompt)),
                                                   long_prompt),
        "2.4M arrays": lambda: raw_request(server.port, post_head("/v1/completions", len(arrays)), arrays),
    }
    for name, load in loads.items():
        worst, n, done = _health_worst_under(server.url, load)
        if worst >= HEALTH_MAX_S:  # once more: a stall repeats, a hiccup of this shared machine does not
            worst, n, done = _health_worst_under(server.url, load)
        assert done >= 1 and n >= 10, (name, n, done)
        assert worst < HEALTH_MAX_S, f"/health took {worst * 1000:.0f} ms under the {name} load"


def test_slow_clients_are_timed_out(server: Server) -> None:
    """A connection that sends nothing, a request head sent a byte at a time, and a body that does not arrive are
    all ended after --request-read-timeout (2 s here); the slow body gets a 408 in OpenAI's shape."""
    def trickle(first: bytes, drip: bytes) -> Tuple[float, bytes]:
        with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
            s.sendall(first)
            t = time.perf_counter()
            got = b""
            while time.perf_counter() - t < 15:
                try:
                    if drip:
                        s.sendall(drip)
                    if select.select([s], [], [], 0.5)[0]:
                        chunk = s.recv(65536)
                        if not chunk:
                            return time.perf_counter() - t, got
                        got += chunk
                except OSError:
                    return time.perf_counter() - t, got
            return time.perf_counter() - t, got

    elapsed, got = trickle(b"", b"")
    assert elapsed < READ_TIMEOUT_S + 2 and got == b""
    elapsed, got = trickle(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n", b"X")
    assert elapsed < READ_TIMEOUT_S + 2 and got == b""
    for first, drip in ((post_head("/v1/completions", 100) + b"{", b" "),
                        (post_head("/v1/completions", None), b"1\r\n \r\n")):
        elapsed, got = trickle(first, drip)
        assert elapsed < READ_TIMEOUT_S + 2
        assert got.startswith(b"HTTP/1.1 408 "), got
        assert_openai_error(got.partition(b"\r\n\r\n")[2], "request_timeout")
    # an unfinished request head may not grow past 16 KiB (h11's limit in uvicorn): a 400 at once
    t = time.perf_counter()
    status, _, _ = raw_request(server.port, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Pad: " + b"a" * 20000)
    assert status == 400 and time.perf_counter() - t < READ_TIMEOUT_S


# ---------------------------------------------------------------------------------------------- 4. SIGTERM
def test_sigterm_ends_open_streams_and_exits_cleanly() -> None:
    """On SIGTERM the server stops accepting at once, lets a request that can finish within
    --graceful-shutdown-timeout finish, then ends every open stream with a server_shutdown error event and
    [DONE] and answers a waiting non-streaming request with a 503; it exits 0 without a traceback, its engine
    process is reaped and the port is free."""
    grace = 4.0
    srv = Server("--max-total-tokens", "8192", "--graceful-shutdown-timeout", str(grace))
    try:
        srv.wait_ready()
        kids = _children(srv.proc.pid)
        assert kids, "no engine process"
        # all of them fit in the KV pool together (a request reserves room for its max_tokens)
        long_body = {"prompt": "Count: 1, 2, 3,", "max_tokens": 1000, "ignore_eos": True, "temperature": 0}
        events: Dict[str, List[str]] = {}
        started: Dict[str, threading.Event] = {}
        answers: Dict[str, httpx.Response] = {}

        def stream(name: str, path: str, body: dict) -> None:
            events[name] = []
            with httpx.stream("POST", srv.url + path, json={**body, "stream": True}, timeout=120) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events[name].append(line[len("data: "):])
                        if events[name][-1].startswith("{\"id\""):
                            started[name].set()

        def whole(name: str) -> None:
            answers[name] = httpx.post(srv.url + "/v1/completions", json=long_body, timeout=120)

        jobs = {"s1": ("/v1/completions", long_body), "s2": ("/v1/completions", long_body),
                "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Count to 1000."}],
                                                   "max_tokens": 1000, "ignore_eos": True})}
        threads = []
        for name, (path, body) in jobs.items():
            started[name] = threading.Event()
            threads.append(threading.Thread(target=stream, args=(name, path, body)))
        threads.append(threading.Thread(target=whole, args=("whole",)))
        for t in threads:
            t.start()
        for name in jobs:
            assert started[name].wait(120), f"{name} never started"
        # a short stream, running when the signal comes, that can finish within the grace period (one more step)
        started["short"] = threading.Event()
        threads.append(threading.Thread(target=stream, args=("short", "/v1/completions",
                                                             {"prompt": "Hello", "max_tokens": 2,
                                                              "ignore_eos": True})))
        threads[-1].start()
        assert started["short"].wait(60)
        srv.proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        time.sleep(0.5)
        with pytest.raises(OSError):  # no longer accepting
            socket.create_connection(("127.0.0.1", srv.port), timeout=2).close()
        for t in threads:
            t.join(120)
        code = srv.proc.wait(60)
        took = time.monotonic() - signalled
    finally:
        srv.kill()
    output = "".join(srv.lines)
    assert code == 0, output
    assert "Traceback" not in output, output
    assert grace - 0.5 < took < grace + 15, took
    short = events["short"]
    assert short[-1] == "[DONE]" and not any("error" in json.loads(e) for e in short[:-1]), short
    assert json.loads(short[-2])["choices"][0]["finish_reason"] == "length"
    for name in jobs:
        ev = events[name]
        assert ev[-1] == "[DONE]", (name, ev[-3:])
        err = json.loads(ev[-2])["error"]
        assert err["type"] == "server_error" and err["code"] == "server_shutdown", (name, err)
        assert len(ev) >= 3, (name, ev)  # it had streamed before it was ended
    r = answers["whole"]
    assert r.status_code == 503 and assert_openai_error(r.content, "server_shutdown", "server_error")
    for k in kids:  # the engine process (and multiprocessing's helper) are gone, reaped
        deadline = time.monotonic() + 10
        while not _gone(k) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _gone(k), f"child process {k} outlived the server"
    with socket.socket() as s:  # the port is free to listen on again
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", srv.port))
        s.listen(1)


# ---------------------------------------------------------------------------------------------- in-process
def test_host_and_origin_policy() -> None:
    from minisrv.server.http.policy import HTTPPolicy

    loop = HTTPPolicy.for_bind("127.0.0.1")
    assert loop.check_host
    for ok in (None, "localhost", "LocalHost:80", "localhost.", "127.0.0.1", "127.255.0.9:1", "[::1]", "[::1]:8",
               "[::ffff:127.0.0.1]"):
        assert loop.host_allowed(ok), ok
    for bad in ("", "evil.com", "evil.com:30000", "127.0.0.1.nip.io", "[::2]", "10.0.0.1", "localhost:x",
                "localhost:", "[::1", "0.0.0.0", "[::]"):
        assert not loop.host_allowed(bad), bad
    assert HTTPPolicy.for_bind("::1").check_host and HTTPPolicy.for_bind("localhost").check_host
    anywhere = HTTPPolicy.for_bind("0.0.0.0")
    assert not anywhere.check_host and anywhere.host_allowed("evil.com")
    named = HTTPPolicy.for_bind("0.0.0.0", ["api.example", "10.0.0.5:8000", "fe80::1"])
    assert named.host_allowed("API.example:443") and named.host_allowed("10.0.0.5:8000")
    assert named.host_allowed("[fe80::1]:1") and named.host_allowed("localhost")
    assert not named.host_allowed("10.0.0.5:8001") and not named.host_allowed("evil.com")
    assert not HTTPPolicy.for_bind("127.0.0.1", ["*"]).check_host
    with pytest.raises(ValueError):
        HTTPPolicy.for_bind("127.0.0.1", ["bad:port"])
    assert loop.origin_allowed(None) and not loop.origin_allowed("http://localhost")
    some = HTTPPolicy.for_bind("127.0.0.1", allowed_origins=["http://App.example:80/", "https://b.example:8443"])
    assert some.origin_allowed("http://app.example") and some.origin_allowed("https://b.example:8443")
    assert not some.origin_allowed("https://app.example") and not some.origin_allowed("https://b.example")
    assert HTTPPolicy.for_bind("127.0.0.1", allowed_origins=["*"]).origin_allowed("http://anything")


def _random_json(rng: random.Random, depth: int = 0):
    atoms = ["", "a", "[", "]", "{", "}", ",", ":", '"', "\\", "\\\\", "é", "\U0001F600", "\n", " ", 'x\\"y']
    t = rng.random()
    if depth > 5 or t < 0.3:
        return rng.choice([rng.randint(-10 ** 6, 10 ** 6), rng.random() * 1e5, True, False, None,
                           "".join(rng.choice(atoms) for _ in range(rng.randint(0, 6)))])
    if t < 0.65:
        return [_random_json(rng, depth + 1) for _ in range(rng.randint(0, 6))]
    return {"".join(rng.choice(atoms) for _ in range(rng.randint(0, 4))): _random_json(rng, depth + 1)
            for _ in range(rng.randint(0, 6))}


def test_large_bodies_parse_in_pieces_like_json_loads(monkeypatch) -> None:
    """The piecewise parse of large bodies (forced here on small ones, with tiny pieces) gives json.loads's value
    for valid documents, and a 400 wherever json.loads fails, on random documents and mutations of them."""
    from minisrv.server.http import json_body as jsonbody
    from minisrv.server.errors import APIError

    monkeypatch.setattr(jsonbody, "SPLIT_BYTES", 0)
    rng = random.Random(1234)
    agree = {"ok": 0, "err": 0}
    for _ in range(1500):
        monkeypatch.setattr(jsonbody, "PIECE_BYTES", rng.choice([1, 3, 16, 200]))
        doc = json.dumps(_random_json(rng), ensure_ascii=rng.random() < 0.5, indent=rng.choice([None, 0, 2]),
                         separators=rng.choice([None, (",", ":"), (" , ", " : ")])).encode()
        if rng.random() < 0.5:
            i = rng.randrange(len(doc) + 1)
            doc = doc[:i] + rng.choice([b"", b",", b"[", b"]", b"{", b"}", b":", b'"', b"\\", b"1", b" "]) \
                + doc[i + rng.randint(0, 1):]
        try:
            want = ("ok", json.loads(doc.decode("utf-8")))
            json.dumps(want[1], ensure_ascii=False).encode("utf-8")  # a lone surrogate is refused too
        except (ValueError, RecursionError):  # UnicodeEncodeError is a ValueError
            want = ("err", None)
        try:
            got = ("ok", jsonbody.decode_json(doc))
        except APIError as e:
            assert e.status == 400
            got = ("err", None)
        assert got[0] == want[0], doc
        if got[0] == "ok":
            assert json.dumps(got[1]) == json.dumps(want[1]), doc
        agree[got[0]] += 1
    assert agree["ok"] > 300 and agree["err"] > 300
    # limits that the piecewise parse checks from the structure, before parsing
    with pytest.raises(APIError, match="nests too deeply"):
        jsonbody.decode_json(b'{"a": ' + b"[" * 65 + b"]" * 65 + b"}")
    monkeypatch.setattr(jsonbody, "MAX_CONTAINERS", 10)
    with pytest.raises(APIError, match="arrays/objects"):
        jsonbody.decode_json(b"[" + b",".join([b"{}"] * 11) + b"]")
    assert jsonbody.decode_json(b'["[[[[", "{{{{", ' + b",".join([b"{}"] * 9) + b"]")[:2] == ["[[[[", "{{{{"]


def test_the_concurrency_limit_answers_in_the_error_shape_with_a_request_id() -> None:
    """--limit-concurrency's 503 (uvicorn's rule: as many connections open as the limit) is an OpenAI-style error
    carrying x-request-id like every other response; the server serves again once a connection closes."""
    from .helpers.server_process import running
    with running("--limit-concurrency", "2") as s:
        held = socket.create_connection(("127.0.0.1", s.port))  # one more open connection: two with the next
        try:
            time.sleep(0.3)
            r = httpx.get(s.url + "/v1/models", headers={"X-Request-Id": "busy-check-1"})
            assert r.status_code == 503, r.text
            assert r.headers["x-request-id"] == "busy-check-1"
            assert r.json()["error"]["code"] == "server_busy"
        finally:
            held.close()
        time.sleep(0.3)
        assert httpx.get(s.url + "/v1/models").status_code == 200
