"""What minisrv adds to uvicorn (server/http/transport.py, and the body's read deadline): slow clients are timed out,
what the HTTP parser or --limit-concurrency refuses is answered in the error shape with an x-request-id, and SIGTERM
ends open streams with an error event and exits cleanly.
"""
from __future__ import annotations

import json
import select
import signal
import socket
import threading
import time
from typing import Dict, List, Tuple

import pytest

from .helpers.http_wire import READ_TIMEOUT_S, assert_openai_error, post_head, raw_request
from .helpers.server_process import Server, children as _children, gone as _gone

httpx = pytest.importorskip("httpx")

pytestmark = pytest.mark.slow  # starts server processes



@pytest.mark.parametrize("head", [b"NOT HTTP AT ALL\r\n\r\n", b"GET /health HTTP/1.1\r\nHost 127.0.0.1\r\n\r\n",
                                  b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: x\r\n\r\n"],
                         ids=["request-line", "header-without-colon", "content-length-not-a-number"])
def test_unparsable_requests_are_a_400_in_the_error_shape(hardened_server: Server, head: bytes) -> None:
    """A request the HTTP parser rejects is answered like every other error: OpenAI's shape, an x-request-id."""
    status, resp_head, body = raw_request(hardened_server.port, head)
    assert status == 400, (resp_head, body)
    assert_openai_error(body)
    headers = dict(line.split(b": ", 1) for line in resp_head.split(b"\r\n")[1:])
    assert len(headers[b"x-request-id"]) == 32 and headers[b"content-type"] == b"application/json", resp_head


def test_slow_clients_are_timed_out(hardened_server: Server) -> None:
    """A connection that sends nothing, a request head sent a byte at a time, and a body that does not arrive are
    all ended after --request-read-timeout (2 s here); the slow body gets a 408 in OpenAI's shape."""
    def trickle(first: bytes, drip: bytes) -> Tuple[float, bytes]:
        with socket.create_connection(("127.0.0.1", hardened_server.port), timeout=30) as s:
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
    status, _, _ = raw_request(hardened_server.port,
                               b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Pad: " + b"a" * 20000)
    assert status == 400 and time.perf_counter() - t < READ_TIMEOUT_S


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
