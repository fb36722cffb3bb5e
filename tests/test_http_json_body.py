"""Request bodies parsed strictly (server/http/json_body.py): on a real server, each kind of bad JSON is a 400 in
OpenAI's shape and the kept-alive connection goes on; in-process, the parse agrees with json.loads on random
documents and mutations of them, and the nesting and container limits are checked against a count made on
json.loads's value.
"""
from __future__ import annotations

import gc
import json
import random
from typing import Any, Tuple

import pytest

from minisrv.server.errors import APIError
from minisrv.server.http.json_body import MAX_DEPTH, decode_json, parse

from .helpers.http_wire import JSON_HEADERS, assert_openai_error, local_port
from .helpers.server_process import Server

httpx = pytest.importorskip("httpx")


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
    (b'{"prompt": "Hi", "max_tokens": 1, "x": "\\ud800"}', "surrogate"),
    (b'{"prompt": "\xff\xfe"}', "UTF-8"),
    (b'{"prompt": "Hi",}', "not valid JSON"),
]


@pytest.mark.slow  # starts a server process
def test_bad_json_is_a_400_and_the_connection_stays_usable(hardened_server: Server) -> None:
    """Deep nesting (a 500 and a dropped connection before), NaN/Infinity literals, overflowing numbers, lone
    surrogates and invalid UTF-8 are each a 400 in OpenAI's shape, and the same kept-alive connection then
    serves a good request. 64 levels are fine, 65 are not."""
    with httpx.Client(base_url=hardened_server.url, timeout=60, headers=JSON_HEADERS) as h:
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


def test_bad_json_messages_in_process() -> None:
    """The same bodies, parsed in-process: each is a 400 whose message names what is wrong."""
    assert decode_json(_deep(MAX_DEPTH))["max_tokens"] == 1
    for body, words in BAD_JSON:
        with pytest.raises(APIError) as e:
            decode_json(body)
        assert e.value.status == 400 and words in e.value.message, (body[:60], e.value.message)
    # what is valid: a leading BOM, an escaped backslash before `ud800`, a surrogate pair, an integer past 64 bits
    assert decode_json(b'\xef\xbb\xbf{"a": "\\\\ud800", "b": "\\ud83d\\ude00", '
                       b'"c": 123456789012345678901234567890}') == \
        {"a": "\\ud800", "b": "\U0001F600", "c": 123456789012345678901234567890}


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


def _shape(value: Any) -> Tuple[int, int]:
    """(arrays/objects, deepest nesting) of a parsed value, counted by walking it."""
    if isinstance(value, dict):
        value = list(value.values())
    elif not isinstance(value, list):
        return 0, 0
    inner = [_shape(v) for v in value]
    return 1 + sum(c for c, _ in inner), 1 + max((d for _, d in inner), default=0)


def test_bodies_parse_like_json_loads_within_the_limits() -> None:
    """decode_json gives json.loads's value for valid documents and a 400 wherever json.loads fails, on random
    documents and mutations of them; with small limits drawn at random, a valid document is refused (naming the
    limit) exactly when its value nests deeper or holds more arrays/objects than they allow."""
    rng = random.Random(1234)
    seen = {"ok": 0, "err": 0, "limit": 0}
    for _ in range(1500):
        doc = json.dumps(_random_json(rng), ensure_ascii=rng.random() < 0.5, indent=rng.choice([None, 0, 2]),
                         separators=rng.choice([None, (",", ":"), (" , ", " : ")])).encode()
        if rng.random() < 0.5:
            i = rng.randrange(len(doc) + 1)
            doc = doc[:i] + rng.choice([b"", b",", b"[", b"]", b"{", b"}", b":", b'"', b"\\", b"1", b" "]) \
                + doc[i + rng.randint(0, 1):]
        max_depth, max_containers = rng.choice([2, 4, 64]), rng.choice([3, 10, 100_000])
        try:
            value = json.loads(doc.decode("utf-8"))
            json.dumps(value, ensure_ascii=False).encode("utf-8")  # a lone surrogate is refused too
        except (ValueError, RecursionError):  # UnicodeEncodeError is a ValueError
            want = "err"
        else:
            containers, depth = _shape(value)
            want = "ok" if depth <= max_depth and containers <= max_containers else "limit"
        try:
            got = decode_json(doc, max_depth, max_containers)
        except APIError as e:
            assert e.status == 400
            limit = "nests too deeply" in e.message or "arrays/objects" in e.message
            assert want == "err" or (want == "limit" and limit), (doc, e.message)
            seen[want] += 1
            continue
        assert want == "ok" and json.dumps(got) == json.dumps(value), doc
        seen["ok"] += 1
    assert min(seen.values()) > 150, seen


def test_limits_count_brackets_outside_strings_only() -> None:
    """The limits are checked from the body's brackets before it is parsed, those inside strings (escaped quotes
    and backslashes included) left out."""
    with pytest.raises(APIError, match="nests too deeply"):
        decode_json(b'{"a": ' + b"[" * 64 + b"]" * 64 + b"}")
    with pytest.raises(APIError, match="arrays/objects"):
        decode_json(b"[" + b",".join([b"{}"] * 10) + b"]", max_containers=10)
    tricky = b'["[[[[", "{{{{", "\\"[[", "\\\\", "\\\\\\"{{{", ' + b",".join([b"{}"] * 9) + b"]"
    assert decode_json(tricky, max_depth=2, max_containers=10)[:5] == ["[[[[", "{{{{", '"[[', "\\", '\\"{{{']


def test_parse_pauses_the_gc_and_restores_it() -> None:
    """The cyclic GC is off while a body is parsed and validated, and as it was afterwards, error or not."""
    assert gc.isenabled()
    assert parse(b"[[], {}]", lambda value: (value, gc.isenabled())) == ([[], {}], False)
    with pytest.raises(APIError, match="not valid JSON"):
        parse(b"[", lambda value: value)
    assert gc.isenabled()
