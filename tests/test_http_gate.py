"""Who may use the server (server/http/gate.py, policy.py): a web page's requests (simple Content-Types, a foreign
Host as DNS rebinding sends it, a foreign Origin) are refused on a real server, and the Host/Origin rules are
checked by hand in-process.
"""
from __future__ import annotations

import json

import pytest

from .helpers.http_wire import JSON_HEADERS, assert_openai_error
from .helpers.server_process import Server

httpx = pytest.importorskip("httpx")




@pytest.mark.slow  # starts a server process
def test_cross_site_requests_are_refused(hardened_server: Server) -> None:
    """What a web page can send without a CORS preflight (text/plain, form encodings), a foreign Host (DNS
    rebinding) and a foreign Origin are refused in OpenAI's error shape; JSON from a loopback name is served."""
    body = json.dumps({"prompt": "Hi", "max_tokens": 1}).encode()
    url = hardened_server.url + "/v1/completions"
    for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                  "application/jsonx", None):
        headers = {"Content-Type": ctype} if ctype else {}
        r = httpx.post(url, content=body, headers=headers, timeout=30)
        assert r.status_code == 415, (ctype, r.text)
        assert_openai_error(r.content, "unsupported_media_type")
    # the page's own name in Host: refused on every route, /health and unknown ones included
    for method, path in (("POST", "/v1/completions"), ("GET", "/v1/models"), ("GET", "/health"),
                         ("GET", "/metrics"), ("GET", "/nothing")):
        for host in ("evil.example", "evil.example:%d" % hardened_server.port, "127.0.0.1.evil.example",
                     "localhost.evil", "myhost.test.evil", "other.test:9090"):
            r = httpx.request(method, hardened_server.url + path, content=body if method == "POST" else None,
                              headers={**JSON_HEADERS, "Host": host}, timeout=30)
            assert r.status_code == 403, (method, path, host, r.text)
            assert_openai_error(r.content, "host_not_allowed")
    for host in ("localhost", "LOCALHOST:1234", "127.0.0.1", "127.8.9.10:30000", "[::1]", "[::1]:80", "myhost.test",
                 "myhost.test:1", "other.test:8080"):
        r = httpx.get(hardened_server.url + "/health", headers={"Host": host}, timeout=30)
        assert r.status_code == 200, (host, r.text)
    # an Origin header: refused unless --allowed-origins names it
    for origin in ("http://evil.example", "null", "http://127.0.0.1:%d" % hardened_server.port, "https://good.example"):
        r = httpx.post(url, content=body, headers={**JSON_HEADERS, "Origin": origin}, timeout=30)
        assert r.status_code == 403, (origin, r.text)
        assert_openai_error(r.content, "origin_not_allowed")
        assert "access-control-allow-origin" not in r.headers
    r = httpx.post(url, content=body, headers={**JSON_HEADERS, "Origin": "http://good.example"}, timeout=60)
    assert r.status_code == 200, r.text
    # application/json with parameters is JSON
    r = httpx.post(url, content=body, headers={"Content-Type": "Application/JSON; charset=utf-8"}, timeout=60)
    assert r.status_code == 200, r.text


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
