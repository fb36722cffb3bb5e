"""The OpenAI-compatible server, end to end: a real server process on a loopback port with the default model.

References are independent of the server: token counts come from the tokenizer, concurrent greedy results are
compared with the same requests sent one by one, disconnects are checked through /metrics.
"""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from typing import Dict, Iterator, Optional

import pytest

openai = pytest.importorskip("openai")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from .helpers.server_process import Server, free_port as _free_port, running  # noqa: E402

httpx = pytest.importorskip("httpx")

pytestmark = pytest.mark.slow  # starts server processes

CHAT_Q = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    with running() as s:
        yield s


@pytest.fixture(scope="module")
def tokenizer():
    from minisrv.checkpoints.loader import load_tokenizer, resolve_model_path
    return load_tokenizer(resolve_model_path(None))


@pytest.fixture(scope="module")
def client(server: Server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


def _metrics(url: str) -> Dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=30).text
    values: Dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            key = s.name + ("{" + ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())) + "}" if s.labels else "")
            values[key] = s.value
    return values


def _wait_idle(url: str, timeout: float = 60) -> Dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = _metrics(url)
        if m["minisrv_num_requests_running"] == 0 and m["minisrv_num_requests_waiting"] == 0 \
                and m["minisrv_kv_cache_usage_ratio"] == 0:
            return m
        assert time.monotonic() < deadline, f"engine did not go idle: {m}"
        time.sleep(0.2)


def _chat_prompt_len(tokenizer, messages) -> int:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return len(tokenizer(text, add_special_tokens=False).input_ids)


# ---------------------------------------------------------------------------------------------- basics
def test_health_models_ready_line(server: Server, client, model: str) -> None:
    assert httpx.get(server.url + "/health").status_code == 200
    assert model.endswith(".gguf")
    ready = [line for line in server.lines if line.startswith("minisrv ready:")]
    assert len(ready) == 1 and server.url in ready[0] and model in ready[0] and "attention_backend=torch" in ready[0]


def test_completion_usage(client, model: str, tokenizer) -> None:
    prompt = "The three primary colors are"
    r = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.object == "text_completion" and len(r.choices) == 1
    assert r.choices[0].finish_reason == "length" and r.choices[0].text
    assert r.usage.prompt_tokens == len(tokenizer(prompt).input_ids)
    assert r.usage.completion_tokens == 8
    assert r.usage.total_tokens == r.usage.prompt_tokens + 8


def test_completion_token_id_prompts(client, model: str, tokenizer) -> None:
    a, b = tokenizer("Once upon a time").input_ids, tokenizer("The sun").input_ids
    r = client.completions.create(model=model, prompt=[a, b], max_tokens=3, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1]
    assert r.usage.prompt_tokens == len(a) + len(b) and r.usage.completion_tokens == 6
    single = client.completions.create(model=model, prompt="The sun", max_tokens=3, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert single.choices[0].text == r.choices[1].text


def test_chat_usage_and_logprobs(client, model: str, tokenizer) -> None:
    r = client.chat.completions.create(model=model, messages=CHAT_Q, max_tokens=32, temperature=0, logprobs=True,
                                       top_logprobs=2)
    ch = r.choices[0]
    assert r.object == "chat.completion" and ch.message.role == "assistant"
    assert "Paris" in ch.message.content
    assert r.usage.prompt_tokens == _chat_prompt_len(tokenizer, CHAT_Q)
    content = ch.logprobs.content
    assert "".join(t.token for t in content) == ch.message.content
    # the EOS that ended the answer is counted but has no text (and no logprobs entry)
    assert r.usage.completion_tokens == len(content) + (1 if ch.finish_reason == "stop" else 0)
    for t in content:
        assert t.logprob <= 0 and len(t.top_logprobs) == 2
        assert t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob
        assert abs(t.top_logprobs[0].logprob - t.logprob) < 1e-4  # greedy picks the top token
        assert bytes(t.bytes).decode() == t.token


def test_completion_logprobs(client, model: str) -> None:
    r = client.completions.create(model=model, prompt="1, 2, 3,", max_tokens=4, temperature=0, logprobs=3,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 4
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])
    for tok, top in zip(lp.tokens, lp.top_logprobs):
        assert tok in top and 3 <= len(top) <= 4


def test_streaming_chat(client, model: str, tokenizer) -> None:
    whole = client.chat.completions.create(model=model, messages=CHAT_Q, max_tokens=32, temperature=0)
    stream = client.chat.completions.create(model=model, messages=CHAT_Q, max_tokens=32, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    text, finish, usage, roles = "", None, None, 0
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            roles += c.delta.role == "assistant"
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    assert roles == 1
    assert text == whole.choices[0].message.content
    assert finish == whole.choices[0].finish_reason
    assert usage is not None and usage.prompt_tokens == _chat_prompt_len(tokenizer, CHAT_Q)
    assert usage.completion_tokens == whole.usage.completion_tokens


def test_n2_and_seed(client, model: str, tokenizer) -> None:
    messages = [{"role": "user", "content": "Write a short poem about the sea."}]
    kw = dict(model=model, messages=messages, n=2, max_tokens=12, temperature=1.0, seed=1234, logprobs=True)
    a = client.chat.completions.create(**kw)
    b = client.chat.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert a.choices[0].message.content != a.choices[1].message.content  # seed + i per choice
    # the prompt is counted once, completion tokens are summed over the choices
    assert a.usage.prompt_tokens == _chat_prompt_len(tokenizer, messages)
    assert a.usage.completion_tokens == sum(len(c.logprobs.content) + (c.finish_reason == "stop")
                                            for c in a.choices)
    c = client.completions.create(model=model, prompt="My favourite animal is", max_tokens=10, temperature=1.0,
                                  seed=7)
    d = client.completions.create(model=model, prompt="My favourite animal is", max_tokens=10, temperature=1.0,
                                  seed=7)
    assert c.choices[0].text == d.choices[0].text


def test_stop_strings(client, model: str) -> None:
    full = client.chat.completions.create(model=model, messages=CHAT_Q, max_tokens=32, temperature=0)
    text = full.choices[0].message.content
    assert "Paris" in text
    r = client.chat.completions.create(model=model, messages=CHAT_Q, max_tokens=32, temperature=0, stop=["Paris"])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == text[:text.index("Paris")]
    # streaming: a partial stop string is held back, never emitted and then taken back
    stream = client.chat.completions.create(model=model, messages=CHAT_Q, max_tokens=32, temperature=0, stream=True,
                                            stop=["Paris", "xyz"])
    pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert "".join(pieces) == text[:text.index("Paris")]
    assert not any("Par" in p for p in pieces)


def test_curl(server: Server, model: str) -> None:
    body = json.dumps({"model": model, "prompt": "Hello", "max_tokens": 4, "temperature": 0})
    out = subprocess.run(["curl", "-sS", "-w", "\n%{http_code}", server.url + "/v1/completions",
                          "-H", "Content-Type: application/json", "-d", body],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    payload, code = out.rsplit("\n", 1)
    assert code == "200"
    r = json.loads(payload)
    assert r["usage"]["completion_tokens"] >= 1 and isinstance(r["choices"][0]["text"], str)


# ---------------------------------------------------------------------------------------------- concurrency
QUESTIONS = [
    "What is the capital of France?", "Name three fruits.", "What is 2 + 3?", "Describe the color blue.",
    "Who wrote Romeo and Juliet?", "What do bees make?", "Why is the sky blue?", "Give me a synonym for happy.",
    "What is the boiling point of water?", "Tell me a fun fact about cats.", "What is photosynthesis?",
    "How many legs does a spider have?", "What is the largest planet?", "Translate 'hello' to Spanish.",
    "What is a prime number?", "Name a famous painter.", "What is the speed of light?", "What is gravity?",
    "Suggest a name for a dog.", "What is the tallest mountain?", "What language is spoken in Brazil?",
    "How do airplanes fly?", "What is an atom?", "Name two oceans.", "What is the opposite of cold?",
    "Why do we sleep?", "What is a haiku?", "Who painted the Mona Lisa?", "What is the freezing point of water?",
    "Give a tip for learning to code.", "What is the moon made of?", "What is a rainbow?",
]


def test_concurrent_streams_match_sequential(server: Server, model: str) -> None:
    aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)

    async def one(q: str):
        stream = await aclient.chat.completions.create(
            model=model, messages=[{"role": "user", "content": q}], max_tokens=24, temperature=0, stream=True,
            logprobs=True, top_logprobs=2)
        text, tokens, finish = "", [], None
        async for chunk in stream:
            for c in chunk.choices:
                text += c.delta.content or ""
                if c.logprobs and c.logprobs.content:
                    tokens += [(t.token, [x.logprob for x in t.top_logprobs]) for t in c.logprobs.content]
                finish = c.finish_reason or finish
        return text, tokens, finish

    async def run():
        together = await asyncio.gather(*[one(q) for q in QUESTIONS])
        alone = [await one(q) for q in QUESTIONS]
        await aclient.close()
        return together, alone

    together, alone = asyncio.run(run())
    assert all(t[2] in ("stop", "length") for t in together)
    for q, (t_text, t_toks, _), (a_text, a_toks, _) in zip(QUESTIONS, together, alone):
        if t_text == a_text:
            continue
        # only a near-tie of the two best logits may flip a greedy choice between batched and single runs
        # (a run that ended earlier chose EOS, which has no logprobs entry: check the run that went on)
        n = min(len(t_toks), len(a_toks))
        i = next((i for i in range(n) if t_toks[i][0] != a_toks[i][0]), n)
        gaps = [abs(toks[i][1][0] - toks[i][1][1]) for toks in (t_toks, a_toks) if i < len(toks)]
        assert gaps and min(gaps) < 1e-4, f"{q!r}: batched {t_text!r} != single {a_text!r} at token {i}, gaps {gaps}"
    m = _wait_idle(server.url)
    assert m["minisrv_kv_cache_pages_used"] == 0


# ---------------------------------------------------------------------------------------------- disconnects
def test_client_disconnect_aborts(server: Server, model: str) -> None:
    before = _metrics(server.url).get("minisrv_request_finish_total{reason=abort}", 0)
    body = {"model": model, "prompt": "Count forever: 1, 2, 3,", "max_tokens": 4000, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as h:
        with h.stream("POST", server.url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            got = 0
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    got += 1
                    if got == 3:
                        break
    # the stream is closed: the engine must drop the request and free its pages
    _wait_idle(server.url)
    # a non-streaming request whose client gives up is aborted too
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json={**body, "stream": False}, timeout=3)
    m = _wait_idle(server.url)
    assert m["minisrv_request_finish_total{reason=abort}"] >= before + 2
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200


# ---------------------------------------------------------------------------------------------- errors
BAD = [
    ("/v1/chat/completions", "{not json", 400, None),
    ("/v1/chat/completions", {"max_tokens": 5}, 400, "messages"),
    ("/v1/chat/completions", {"messages": CHAT_Q, "max_tokens": "abc"}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": CHAT_Q, "temperature": -1}, 400, "temperature"),
    ("/v1/chat/completions", {"messages": CHAT_Q, "n": 0}, 400, "n"),
    ("/v1/chat/completions", {"messages": "hello"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": CHAT_Q, "top_p": 1.5}, 400, "top_p"),
    ("/v1/chat/completions", {"messages": CHAT_Q, "stop": [""]}, 400, None),
    ("/v1/chat/completions", {"messages": CHAT_Q, "model": "no-such-model"}, 404, "model"),
    ("/v1/completions", {"prompt": 12}, 400, "prompt"),
    ("/v1/completions", {"prompt": []}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1, 10 ** 9]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "Hi", "logprobs": 50}, 400, "logprobs"),
    ("/v1/completions", {}, 400, "prompt"),
    ("/v1/nothing", {}, 404, None),
]


@pytest.mark.parametrize("path,body,status,param", BAD, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD)])
def test_bad_inputs(server: Server, path: str, body, status: int, param: Optional[str]) -> None:
    data = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(server.url + path, content=data, headers={"Content-Type": "application/json"}, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err


def test_over_context_names_both_numbers(server: Server, client, model: str, tokenizer) -> None:
    n_prompt = _chat_prompt_len(tokenizer, CHAT_Q)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=CHAT_Q, max_tokens=9000)
    msg = e.value.body["message"] if isinstance(e.value.body, dict) else str(e.value)
    assert str(n_prompt) in msg and "9000" in msg and "8192" in msg
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=CHAT_Q, max_tokens=2)
    # still serving
    r = client.chat.completions.create(model=model, messages=CHAT_Q, max_tokens=2)
    assert r.usage.completion_tokens >= 1


def test_metrics(server: Server) -> None:
    m = _metrics(server.url)
    assert m["minisrv_requests_total{endpoint=/v1/chat/completions,status=200}"] >= 5
    assert m["minisrv_requests_total{endpoint=/v1/chat/completions,status=400}"] >= 5
    assert m["minisrv_prompt_tokens_total"] > 0 and m["minisrv_generation_tokens_total"] > 0
    assert m["minisrv_time_to_first_token_seconds_count"] > 0
    assert m["minisrv_inter_token_latency_seconds_count"] > 0
    assert m["minisrv_e2e_request_latency_seconds_count"] > 0
    assert m["minisrv_kv_cache_pages_total"] > 0


def test_routes_are_counted_under_their_own_endpoint(server: Server) -> None:
    """/tokenize and /v1/tokenize (and detokenize) are one endpoint each in the metrics, and so are the Responses and
    embeddings routes, answered or refused; none is "other"."""
    before = _metrics(server.url)
    for path in ("/tokenize", "/v1/tokenize"):
        assert httpx.post(server.url + path, json={"prompt": "hello"}).status_code == 200
    assert httpx.post(server.url + "/v1/detokenize", json={"tokens": [1, 2]}).status_code == 200
    refused = {path: httpx.post(server.url + path, json={"bad": 1}).status_code
               for path in ("/v1/responses", "/v1/embeddings")}
    after = _metrics(server.url)

    def grew(key: str) -> float:
        return after.get(key, 0) - before.get(key, 0)
    assert grew("minisrv_requests_total{endpoint=/v1/tokenize,status=200}") == 2
    assert grew("minisrv_requests_total{endpoint=/v1/detokenize,status=200}") == 1
    for path, status in refused.items():
        assert status >= 400 and grew(f"minisrv_requests_total{{endpoint={path},status={status}}}") == 1
    assert not any(grew(k) for k in after if k.startswith("minisrv_requests_total{endpoint=other"))


# ---------------------------------------------------------------------------------------------- in-process
class _IdleEngine:
    """Stands in for the engine process: the API-key gate never lets a request reach it."""

    ready, dead = True, False

    async def fresh_stats(self, timeout: float = 0.5):
        return {}


def test_api_key(tokenizer) -> None:
    from minisrv.server.messages import EngineInfo
    from minisrv.server.app import create_app
    from minisrv.server.state import ServerState

    info = EngineInfo("m.gguf", "torch", "cpu", 8192, 8192, 49152)
    app = create_app(ServerState(client=_IdleEngine(), tokenizer=tokenizer, info=info, served_model_name="m",
                                 api_key="sekret"))

    async def run() -> None:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as h:
            assert (await h.get("/health")).status_code == 200
            for method, path in (("GET", "/v1/models"), ("GET", "/metrics"), ("POST", "/v1/completions"),
                                 ("POST", "/v1/chat/completions")):
                for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"}):
                    r = await h.request(method, path, headers=headers, json={"prompt": "x"})
                    assert r.status_code == 401, (path, headers)
                    assert r.json()["error"]["code"] == "invalid_api_key"
            r = await h.get("/v1/models", headers={"Authorization": "Bearer sekret"})
            assert r.status_code == 200 and r.json()["data"][0]["id"] == "m"

    asyncio.run(run())


def test_startup_error_exits_nonzero() -> None:
    r = subprocess.run([sys.executable, "-m", "minisrv.launch_server", "--port", str(_free_port()),
                        "--attention-backend", "fa", "--device", "cpu"], capture_output=True, text=True, timeout=180)
    assert r.returncode == 1
    assert "engine failed to start" in r.stderr and "fa" in r.stderr
    r = subprocess.run([sys.executable, "-m", "minisrv.launch_server", "--model", "/no/such/model.gguf"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "/no/such/model.gguf" in r.stderr
