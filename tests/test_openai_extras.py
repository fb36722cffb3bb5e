"""Routes and headers beside the OpenAI API, against one real server (the default model, an API key, a small KV
pool, CORS for one origin): the tokenizer endpoints (vLLM's shapes, as lm-eval's remote tokenizer uses them),
/tokenizer_info, /get_model_info and /server_info, /flush_cache and the prefix-cache metrics, x-request-id, CORS.

References are independent of the server: token ids and texts come from the HF tokenizer loaded here
(encode/decode, apply_chat_template), paths from the model resolver, cache hits from repeating a prompt.
"""
from __future__ import annotations

import json
import re
import time
from typing import Dict, Iterator, Optional

import pytest

from .helpers.server_process import Server, running
from prometheus_client.parser import text_string_to_metric_families

httpx = pytest.importorskip("httpx")

pytestmark = pytest.mark.slow  # starts server processes

POOL_TOKENS = 2048  # --max-total-tokens: the enforced max_model_len
MAX_BYTES = 256 * 1024  # --max-request-bytes
API_KEY = "sk-extras"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
UI = "http://ui.example"  # --allowed-origins
HEX32 = re.compile(r"[0-9a-f]{32}")


# ---------------------------------------------------------------------------------------------- the server
@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    with running("--max-total-tokens", str(POOL_TOKENS), "--max-request-bytes", str(MAX_BYTES),
                 "--api-key", API_KEY, "--allowed-origins", UI) as s:
        yield s


@pytest.fixture(scope="module")
def http(server: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def tokenizer():
    from minisrv.checkpoints.loader import load_tokenizer, resolve_model_path
    return load_tokenizer(resolve_model_path(None))


def assert_openai_error(r: httpx.Response, status: int, code: Optional[str] = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    if code is not None:
        assert err["code"] == code, err
    return err


def metrics(http: httpx.Client) -> Dict[str, float]:
    values: Dict[str, float] = {}
    for fam in text_string_to_metric_families(http.get("/metrics").text):
        for s in fam.samples:
            if not s.labels:
                values[s.name] = s.value
    return values


# ---------------------------------------------------------------------------------------------- tokenizer routes
TEXTS = ["Hello world", "", "  leading spaces and\ttabs\nnewlines ", "héllo wörld ✓ 日本語 🙂",
         "<|im_start|>user\nhi<|im_end|>", "1234567890 " * 20]


def test_tokenize_and_detokenize_match_the_tokenizer(http: httpx.Client, tokenizer) -> None:
    model = http.get("/v1/models").json()["data"][0]["id"]
    for text in TEXTS:
        for special in (True, False):
            want = tokenizer(text, add_special_tokens=special).input_ids
            r = http.post("/tokenize", json={"prompt": text, "add_special_tokens": special, "model": model})
            assert r.status_code == 200, r.text
            assert r.json() == {"count": len(want), "max_model_len": POOL_TOKENS, "tokens": want}, text
            back = http.post("/detokenize", json={"tokens": want})
            assert back.status_code == 200, back.text
            assert back.json() == {"prompt": tokenizer.decode(want)}
        # add_special_tokens defaults to true for a prompt; /v1/tokenize is the same route; token strings on request
        r = http.post("/v1/tokenize", json={"prompt": text, "return_token_strs": True}).json()
        assert r["tokens"] == tokenizer(text).input_ids
        assert r["token_strs"] == tokenizer.convert_ids_to_tokens(r["tokens"])
    # what lm-eval's RemoteTokenizer sends: encode without special tokens, decode, the eos text back to its id
    eos = http.get("/tokenizer_info").json()["eos_token"]
    assert http.post("/tokenize", json={"prompt": eos, "add_special_tokens": False}).json()["tokens"][0] == \
        tokenizer.eos_token_id
    # a text longer than the limit is tokenized all the same (in a worker thread: over 16 KiB)
    long_text = "The quick brown fox jumps over the lazy dog. " * 500
    r = http.post("/tokenize", json={"prompt": long_text}).json()
    assert r["tokens"] == tokenizer(long_text).input_ids and r["count"] > POOL_TOKENS
    assert http.post("/v1/detokenize", json={"tokens": r["tokens"]}).json()["prompt"] == tokenizer.decode(r["tokens"])


def test_tokenize_chat_form_matches_the_template(http: httpx.Client, tokenizer) -> None:
    chats = [
        [{"role": "user", "content": "What is the capital of France?"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
         {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": [{"type": "text", "text": "Bye"}]}],
    ]
    for msgs in chats:
        flat = [{**m, "content": m["content"] if isinstance(m["content"], str) else m["content"][0]["text"]}
                for m in msgs]
        for gen in (True, False):
            text = tokenizer.apply_chat_template(flat, add_generation_prompt=gen, tokenize=False)
            want = tokenizer(text, add_special_tokens=False).input_ids
            r = http.post("/tokenize", json={"messages": msgs, "add_generation_prompt": gen})
            assert r.status_code == 200, r.text
            assert r.json() == {"count": len(want), "max_model_len": POOL_TOKENS, "tokens": want}
    # the count is the prompt length of the same chat request
    r = http.post("/v1/chat/completions", json={"messages": chats[0], "max_tokens": 1})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == http.post("/tokenize", json={"messages": chats[0]}).json()["count"]


def test_tokenizer_info_and_model_info(http: httpx.Client, tokenizer) -> None:
    from minisrv.checkpoints.loader import resolve_model_path
    path = resolve_model_path(None)
    info = http.get("/tokenizer_info")
    assert info.status_code == 200, info.text
    info = info.json()
    for name in ("eos_token", "bos_token", "pad_token", "eos_token_id", "bos_token_id", "pad_token_id"):
        assert info[name] == getattr(tokenizer, name), name
    assert info["eos_token"]
    assert info["chat_template"] == tokenizer.chat_template and "messages" in info["chat_template"]
    assert info["tokenizer_class"] == type(tokenizer).__name__
    assert info["model_max_length"] == POOL_TOKENS and info["vocab_size"] == len(tokenizer)
    assert info["tokenizer_path"] == path
    card = http.get("/v1/models").json()["data"][0]
    model = http.get("/get_model_info")
    assert model.status_code == 200, model.text
    model = model.json()
    assert model["model_path"] == path and model["tokenizer_path"] == path
    assert model["served_model_name"] == card["id"] and model["is_generation"] is True
    assert model["max_model_len"] == card["max_model_len"] == POOL_TOKENS
    assert model["context_length"] >= POOL_TOKENS
    assert http.get("/model_info").json() == model  # SGLang's newer name
    for route in ("/server_info", "/get_server_info"):  # what a router in front reads the model's name from
        server = http.get(route).json()
        assert (server["served_model_name"], server["model_path"], server["tokenizer_path"]) == (card["id"], path, path)


def test_bad_inputs_are_400s(server: Server, http: httpx.Client, tokenizer) -> None:
    vocab = len(tokenizer)
    bad = [
        ("/tokenize", b"{}", None),
        ("/tokenize", b'{"prompt": 5}', "prompt"),
        ("/tokenize", b'{"prompt": ["a"]}', "prompt"),
        ("/tokenize", b'{"prompt": "a", "add_special_tokens": "yes"}', "add_special_tokens"),
        ("/tokenize", b'{"prompt": "a", "messages": [{"role": "user", "content": "b"}]}', None),
        ("/tokenize", b'{"messages": []}', None),
        ("/tokenize", b'{"messages": [{"role": "wizard", "content": "b"}]}', "messages"),
        ("/tokenize", b'{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}', "messages"),
        ("/tokenize", b'{"messages": [{"role": "user", "content": "b"}], "continue_final_message": true}', None),
        ("/tokenize", b'{"prompt": "a", "model": 7}', "model"),
        ("/tokenize", b'{"prompt": "a", "x": ' + b"[" * 70 + b"]" * 70 + b"}", None),
        ("/tokenize", b'{"prompt": "a", "x": NaN}', None),
        ("/tokenize", b'{"prompt": "\\ud800"}', None),
        ("/tokenize", b'{"prompt": "a"', None),
        ("/tokenize", b'["prompt"]', None),
        ("/tokenize", b'{"prompt": "\xff"}', None),
        ("/detokenize", b"{}", "tokens"),
        ("/detokenize", b'{"tokens": "12"}', "tokens"),
        ("/detokenize", b'{"tokens": [1, true]}', "tokens"),
        ("/detokenize", b'{"tokens": [1.5]}', "tokens"),
        ("/detokenize", b'{"tokens": [-1]}', "tokens"),
        ("/detokenize", b'{"tokens": [%d]}' % vocab, "tokens"),
        ("/detokenize", b'{"tokens": [%d]}' % 2 ** 70, "tokens"),
        ("/detokenize", b'{"tokens": [[1]]}', "tokens"),
        ("/flush_cache", b"[1]", None),
    ]
    headers = {"Content-Type": "application/json"}
    for path, body, param in bad:
        r = http.post(path, content=body, headers=headers)
        err = assert_openai_error(r, 400)
        assert err["type"] == "invalid_request_error"
        if param is not None:
            assert err["param"] == param, (body, err)
    many = list(range(3, 3 + 5000))  # checked in a worker thread: the bad id is found all the same
    err = assert_openai_error(http.post("/detokenize", json={"tokens": many + [vocab + 1]}), 400, "invalid_token_id")
    assert f"tokens[{len(many)}]" in err["message"]
    assert_openai_error(http.post("/tokenize", json={"prompt": "a", "model": "other"}), 404, "model_not_found")
    assert_openai_error(http.post("/tokenize", json={"prompt": "a" * MAX_BYTES}), 413, "request_too_large")
    assert_openai_error(http.post("/tokenize", content=b'{"prompt": "a"}', headers={"Content-Type": "text/plain"}),
                        415, "unsupported_media_type")
    assert_openai_error(httpx.post(server.url + "/tokenize", json={"prompt": "a"}), 401, "invalid_api_key")
    assert_openai_error(http.get("/flush_cache"), 405)
    # still serving
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200
    assert http.post("/tokenize", json={"prompt": "Hello world"}).json()["tokens"] == \
        tokenizer("Hello world").input_ids


# ---------------------------------------------------------------------------------------------- the prefix cache
JSON_ONLY = {"Content-Type": "application/json"}  # every POST must say so, even one without a body


def _flush(http: httpx.Client, timeout: float = 30) -> None:
    """Flush, retrying while a request that just ended is still being wound down."""
    deadline = time.monotonic() + timeout
    while True:
        r = http.post("/flush_cache", headers=JSON_ONLY)
        if r.status_code == 200:
            assert r.json() == {"flushed": True}
            return
        assert_openai_error(r, 400, "requests_pending")
        assert time.monotonic() < deadline, "the cache could not be flushed"
        time.sleep(0.1)


def test_flush_cache_and_cache_metrics(http: httpx.Client, tokenizer) -> None:
    _flush(http)
    m = metrics(http)
    assert m["minisrv_prefix_cache_tokens"] == 0
    hits = m["minisrv_cached_prompt_tokens_total"]
    prompt = "In a distant valley there lived a clockmaker who repaired every clock in town. " * 8
    n = len(tokenizer(prompt).input_ids)
    greedy = {"prompt": prompt, "max_tokens": 2, "temperature": 0}
    first = http.post("/v1/completions", json=greedy)
    assert first.status_code == 200, first.text
    m = metrics(http)
    assert m["minisrv_prefix_cache_tokens"] > 0
    assert m["minisrv_cached_prompt_tokens_total"] == hits  # nothing was cached before it
    second = http.post("/v1/completions", json=greedy)
    assert second.status_code == 200, second.text
    assert second.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]
    grown = metrics(http)["minisrv_cached_prompt_tokens_total"] - hits
    assert n // 2 <= grown < n, (grown, n)  # all but the prompt's last token(s) came from the cache
    assert http.post("/v1/completions", json=greedy).status_code == 200
    assert http.post("/flush_cache", json={}).json() == {"flushed": True}  # an empty object is fine too
    assert metrics(http)["minisrv_prefix_cache_tokens"] == 0
    assert_openai_error(http.post("/flush_cache"), 415, "unsupported_media_type")


def test_flush_cache_is_refused_while_a_request_runs(server: Server, http: httpx.Client) -> None:
    body = {"prompt": "Count to a thousand:", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as stream:
        lines = stream.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))  # it is running
        r = http.post("/flush_cache", headers=JSON_ONLY)
        err = assert_openai_error(r, 400, "requests_pending")
        assert "pending requests" in err["message"]
    _flush(http)  # the stream was closed: its request is aborted, then the flush goes through
    assert metrics(http)["minisrv_prefix_cache_tokens"] == 0


# ---------------------------------------------------------------------------------------------- x-request-id
def test_request_id_is_echoed_or_made(server: Server, http: httpx.Client) -> None:
    mine = "req-" + "abc_DEF.123:~" * 3
    for method, path, body, status in (("GET", "/v1/models", None, 200), ("GET", "/no/such/route", None, 404),
                                       ("POST", "/tokenize", {"prompt": 5}, 400), ("GET", "/health", None, 200)):
        r = http.request(method, path, json=body, headers={"X-Request-Id": mine})
        assert r.status_code == status and r.headers["x-request-id"] == mine, (path, r.headers)
        made = [http.request(method, path, json=body).headers["x-request-id"] for _ in range(2)]
        assert all(HEX32.fullmatch(x) for x in made) and made[0] != made[1], made
    # refused before any route: made up too (no API key)
    r = httpx.get(server.url + "/v1/models", headers={"X-Request-Id": "abc"}, timeout=30)
    assert r.status_code == 401 and r.headers["x-request-id"] == "abc"
    # not echoed: too long, with spaces, empty, not ASCII
    for odd in ("x" * 129, "two words", "", "caf\u00e9".encode("utf-8")):
        r = http.get("/health", headers={"X-Request-Id": odd})
        assert HEX32.fullmatch(r.headers["x-request-id"]), (odd, r.headers["x-request-id"])
    assert len(http.get("/health", headers={"X-Request-Id": "y" * 128}).headers.get_list("x-request-id")) == 1
    # a stream's response headers
    body = {"prompt": "Hello", "max_tokens": 2, "stream": True}
    with http.stream("POST", "/v1/completions", json=body, headers={"X-Request-Id": "stream-1"}) as s:
        assert s.status_code == 200 and s.headers["content-type"].startswith("text/event-stream")
        assert s.headers["x-request-id"] == "stream-1"
        assert "data: [DONE]" in s.read().decode()
    with http.stream("POST", "/v1/chat/completions", json={**body, "messages": [{"role": "user", "content": "Hi"}]}) \
            as s:
        assert s.status_code == 200 and HEX32.fullmatch(s.headers["x-request-id"])
        s.read()


# ---------------------------------------------------------------------------------------------- CORS
def test_cors_for_the_allowed_origin(server: Server, http: httpx.Client) -> None:
    # a preflight: answered without the API key, with the headers asked for
    pre = {"Origin": UI, "Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "authorization, content-type, x-request-id"}
    r = httpx.options(server.url + "/v1/chat/completions", headers=pre, timeout=30)
    assert r.status_code == 200, r.text
    assert r.headers["access-control-allow-origin"] == UI
    assert [m.strip() for m in r.headers["access-control-allow-methods"].split(",")] == ["GET", "POST", "OPTIONS"]
    assert r.headers["access-control-allow-headers"] == "authorization, content-type, x-request-id"
    assert int(r.headers["access-control-max-age"]) > 0 and "Origin" in r.headers["vary"]
    # without Access-Control-Request-Headers: Authorization and Content-Type
    r = httpx.options(server.url + "/tokenize", headers={"Origin": UI, "Access-Control-Request-Method": "POST"},
                      timeout=30)
    assert r.status_code == 200
    assert {h.strip().lower() for h in r.headers["access-control-allow-headers"].split(",")} == \
        {"authorization", "content-type"}
    # another origin: refused, without CORS headers
    bad = httpx.options(server.url + "/v1/chat/completions", headers={**pre, "Origin": "http://evil.example"},
                        timeout=30)
    assert_openai_error(bad, 403, "origin_not_allowed")
    assert not [h for h in bad.headers if h.startswith("access-control-")]
    r = http.post("/tokenize", json={"prompt": "a"}, headers={"Origin": "http://evil.example"})
    assert_openai_error(r, 403, "origin_not_allowed")
    assert "access-control-allow-origin" not in r.headers
    # actual requests from the allowed origin: Allow-Origin, Vary, x-request-id readable by the page
    for method, path, body, status in (("POST", "/tokenize", {"prompt": "a"}, 200), ("GET", "/v1/models", None, 200),
                                       ("GET", "/nothing", None, 404), ("POST", "/detokenize", {"tokens": [-1]}, 400)):
        r = http.request(method, path, json=body, headers={"Origin": UI})
        assert r.status_code == status, r.text
        assert r.headers["access-control-allow-origin"] == UI and "Origin" in r.headers["vary"]
        assert "x-request-id" in r.headers["access-control-expose-headers"].lower()
    r = httpx.get(server.url + "/v1/models", headers={"Origin": UI}, timeout=30)  # no key: the page may read the 401
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] == UI
    with http.stream("POST", "/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "stream": True},
                     headers={"Origin": UI}) as s:
        assert s.headers["access-control-allow-origin"] == UI
        s.read()
    # without an Origin: no CORS headers at all, and an OPTIONS is no preflight (the API key applies)
    for r in (http.get("/v1/models"), http.post("/tokenize", json={"prompt": "a"}), http.get("/health")):
        assert r.status_code == 200 and not [h for h in r.headers if h.startswith("access-control-")]
    assert httpx.options(server.url + "/v1/models", timeout=30).status_code == 401
    assert http.options("/v1/models").status_code == 405


def test_cors_policy_by_hand() -> None:
    from minisrv.server.http.policy import HTTPPolicy
    off = HTTPPolicy.for_bind("127.0.0.1")
    assert not off.cors and off.cors_headers(UI) == [] and off.cors_headers(None) == []
    some = HTTPPolicy.for_bind("127.0.0.1", allowed_origins=["http://UI.example:80/"])
    assert dict(some.cors_headers("http://ui.example"))[b"access-control-allow-origin"] == b"http://ui.example"
    assert some.cors_headers("http://other.example") == [] and some.cors_headers(None) == []
    anyone = HTTPPolicy.for_bind("127.0.0.1", allowed_origins=["*"])
    h = dict(anyone.cors_headers("http://whatever.example"))
    assert h[b"access-control-allow-origin"] == b"*" and b"vary" not in h


def test_server_is_still_healthy(server: Server, http: httpx.Client) -> None:
    assert json.loads(httpx.get(server.url + "/health", timeout=30).content) == {"status": "ok"}
    assert http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1}).status_code == 200
