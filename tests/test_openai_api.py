"""The OpenAI API features clients rely on, against a real server on the default model with the official client:
structured outputs (parse with a Pydantic model, json_object, regex), echo with logprobs and max_tokens 0 (prompt
scoring, as lm-eval does), cached-token usage, logit_bias, top_p 0, system_fingerprint, and 400s for every new kind
of bad input. Tool calling has its own model and tests: test_openai_tools.py."""
from __future__ import annotations

import json
from typing import Iterator

import pytest

openai = pytest.importorskip("openai")
pydantic = pytest.importorskip("pydantic")

from minisrv import LLM, SamplingParams  # noqa: E402

from .helpers.server_process import Server, running  # noqa: E402

httpx = pytest.importorskip("httpx")

pytestmark = pytest.mark.slow  # starts server processes

MODEL = "SmolLM2-135M-Instruct.Q4_1.gguf"  # the served name of the default model
ASK = [{"role": "user", "content": "What is the weather in Paris for the next 3 days?"}]


@pytest.fixture(scope="module")
def srv() -> Iterator[Server]:
    with running() as s:
        yield s


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=300)


def test_parse_with_a_pydantic_model(client):
    class City(pydantic.BaseModel):
        name: str
        country: str

    r = client.beta.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": "Describe Paris."}],
                                           response_format=City, max_tokens=60, temperature=0) \
        if hasattr(client, "beta") and hasattr(client.beta, "chat") else \
        client.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": "Describe Paris."}],
                                      response_format=City, max_tokens=60, temperature=0)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "stop", msg.content
    assert isinstance(msg.parsed, City), msg.content
    assert r.system_fingerprint and r.system_fingerprint.startswith("fp_minisrv")


def test_json_object_and_regex(client, srv):
    q = 'What is the capital of France? Answer in JSON with the key "capital".'
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": q}],
                                       response_format={"type": "json_object"}, max_tokens=100, temperature=0)
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    r = httpx.post(srv.url + "/v1/completions", timeout=120, json={
        "prompt": "Call me at", "regex": "[0-9]{3}-[0-9]{4}", "max_tokens": 20, "temperature": 0.8, "seed": 3})
    import re
    assert r.status_code == 200 and re.fullmatch(r"[0-9]{3}-[0-9]{4}", r.json()["choices"][0]["text"])


def test_echo_logprobs_and_max_tokens_zero_score_the_prompt(srv):
    prompt = "The capital of France is Paris"
    r = httpx.post(srv.url + "/v1/completions", timeout=120, json={
        "prompt": prompt, "echo": True, "logprobs": 2, "max_tokens": 0, "temperature": 0})
    assert r.status_code == 200, r.text
    ch = r.json()["choices"][0]
    lp = ch["logprobs"]
    assert ch["text"] == prompt and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    llm = LLM(attention_backend="torch", log_level="warning", max_total_tokens=4096)
    ref = llm.generate(prompt, SamplingParams(max_tokens=0, prompt_logprobs=2), use_tqdm=False)[0]
    assert len(lp["token_logprobs"]) == len(ref.prompt_token_ids)
    for got, want in zip(lp["token_logprobs"][1:], ref.prompt_logprobs[1:]):
        assert abs(got - want.logprob) < 1e-3
    assert all(len(t) >= 2 for t in lp["top_logprobs"][1:])
    assert "".join(lp["tokens"]) == prompt
    # with generation after the echo: the prompt's tokens, then the new ones
    r = httpx.post(srv.url + "/v1/completions", timeout=120, json={
        "prompt": prompt, "echo": True, "logprobs": 0, "max_tokens": 3, "temperature": 0})
    lp2 = r.json()["choices"][0]["logprobs"]
    assert len(lp2["tokens"]) == len(ref.prompt_token_ids) + 3
    assert r.json()["choices"][0]["text"].startswith(prompt)


def test_cached_tokens_in_usage(client):
    long = "You are a helpful assistant that answers in one word. " * 12
    msgs = [{"role": "system", "content": long}, {"role": "user", "content": "Capital of Italy?"}]
    first = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2, temperature=0)
    again = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens >= again.usage.prompt_tokens - 2
    assert first.usage.prompt_tokens_details.cached_tokens < again.usage.prompt_tokens_details.cached_tokens
    assert again.choices[0].message.content == first.choices[0].message.content  # the same greedy text


def test_logit_bias_and_top_p_zero(client, srv):
    tok_r = httpx.post(srv.url + "/v1/completions", timeout=120, json={
        "prompt": "Hello", "max_tokens": 3, "temperature": 0, "logit_bias": {"42": 100}})
    assert tok_r.status_code == 200, tok_r.text
    greedy = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=0)
    top0 = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=1.0, top_p=0)
    assert top0.choices[0].text == greedy.choices[0].text


@pytest.mark.parametrize("body,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"regex": "[unclosed"}, "response_format"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 500}}, "logit_bias"),
])
def test_bad_new_inputs_are_400s(srv, body, param):
    r = httpx.post(srv.url + "/v1/chat/completions", timeout=60,
                   json={"messages": ASK, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
    ok = httpx.post(srv.url + "/v1/chat/completions", timeout=60, json={"messages": ASK, "max_tokens": 2})
    assert ok.status_code == 200
