"""Speculative decoding (NGRAM) behind the HTTP app: a tiny random Qwen2 in a real engine in this process
(helpers/local_engine.py), with speculation on, answers every chat completion with the text, usage and finish
reason of the same engine without speculation, streamed or not, also where a stop string or max_tokens ends the
answer inside a run of kept drafts; /metrics reports the acceptance.

Random weights do not copy their prompt, so the drafts that get kept come from the proposer's store of finished
requests: once a request has run on the speculating engine, the same prompt again finds its earlier history, and
its greedy answer is that history's continuation, so whole runs of drafts are kept. Each check asserts that drafts
were kept during it: without that it would prove nothing about the verify path.
"""
from __future__ import annotations

import asyncio
from typing import Any, Dict, List, Tuple

import pytest

from minisrv.engine.engine import Engine
from minisrv.server.app import create_app
from minisrv.server.messages import EngineInfo
from minisrv.server.state import ServerState

from .helpers.local_engine import LocalEngine, call, events, httpx

NUM_DRAFT_TOKENS = 5  # the request's last token and 4 drafts a verify step
QUESTION = [{"role": "user", "content": "Please repeat the following text exactly."}]
BODY = {"messages": QUESTION, "temperature": 0, "max_tokens": 32, "ignore_eos": True}


class ReportingEngine(LocalEngine):
    """LocalEngine whose stats are the engine's own, as the engine process reports them to /metrics."""

    async def fresh_stats(self, timeout: float = 0.5) -> Dict[str, Any]:
        return self.engine.stats()


def _app(path: str, **spec) -> Tuple[Engine, Any]:
    engine = Engine(model=path, attention_backend="torch", dtype="float32", log_level="warning",
                    max_total_tokens=4096, **spec)
    state = ServerState(client=ReportingEngine(engine), tokenizer=engine.parts.tokenizer, served_model_name="m",
                        info=EngineInfo.from_engine(engine))
    return engine, create_app(state)


@pytest.fixture(scope="module")
def plain(tiny_qwen2_tools):
    return _app(tiny_qwen2_tools)[1]


@pytest.fixture(scope="module")
def reference(plain) -> Dict[str, Any]:
    """BODY's answer without speculation."""
    return _answer(plain)


@pytest.fixture(scope="module")
def spec(tiny_qwen2_tools):
    """The speculating engine and its app, after one request with BODY's prompt (its history is in the store)."""
    engine, app = _app(tiny_qwen2_tools, speculative_algorithm="NGRAM",
                       speculative_num_draft_tokens=NUM_DRAFT_TOKENS)
    r = call(app, "/v1/chat/completions", BODY)
    assert r.status_code == 200, r.text
    return engine, app


def _kept_during(engine: Engine, fn):
    """fn()'s result, and the drafts kept while it ran."""
    out, gained = _gained_during(engine, fn)
    return out, gained["spec_accepted_tokens"]


def _gained_during(engine: Engine, fn):
    """fn()'s result, and how much each speculation counter grew while it ran."""
    before = engine.stats()
    out = fn()
    after = engine.stats()
    return out, {k: after[k] - before[k] for k in after if k.startswith("spec_")}


def _answer(app, **extra) -> Dict[str, Any]:
    r = call(app, "/v1/chat/completions", {**BODY, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def _streamed(app, **extra) -> Tuple[List[Dict[str, Any]], Dict[str, Any]]:
    """A streamed answer's content deltas (with their logprobs) and its usage chunk."""
    ev = events(call(app, "/v1/chat/completions", {**BODY, "stream": True, "stream_options": {"include_usage": True},
                                                    "logprobs": True, **extra}))
    assert ev[-1] == "[DONE]" and ev[-2]["choices"] == []
    return [c for e in ev[:-2] for c in e["choices"]], ev[-2]["usage"]


def test_streamed_and_unstreamed_answers_equal_the_plain_engines(spec, reference):
    engine, app = spec
    whole, kept = _kept_during(engine, lambda: _answer(app))
    assert kept > 0, "no draft was kept: the verify path was not exercised"
    (chunks, usage), kept = _kept_during(engine, lambda: _streamed(app))
    assert kept > 0
    text = reference["choices"][0]["message"]["content"]
    assert text and whole["choices"][0]["message"]["content"] == text
    assert "".join(c["delta"].get("content") or "" for c in chunks) == text
    # a delta may carry several tokens (a verify step adds up to NUM_DRAFT_TOKENS): each has its logprobs entry
    n_tokens = sum(len((c.get("logprobs") or {}).get("content") or []) for c in chunks)
    assert usage["completion_tokens"] == whole["usage"]["completion_tokens"] == \
        reference["usage"]["completion_tokens"] == BODY["max_tokens"] == n_tokens
    assert [c["finish_reason"] for c in chunks if c["finish_reason"]] == ["length"]
    assert whole["choices"][0]["finish_reason"] == reference["choices"][0]["finish_reason"] == "length"


def test_a_stop_string_inside_a_kept_run_ends_the_text_where_plain_decoding_does(spec, plain, reference):
    engine, app = spec
    text = reference["choices"][0]["message"]["content"]
    stop = text[len(text) // 2:len(text) // 2 + 3]  # a few characters mid-answer, inside a run of kept drafts
    assert stop.strip() and text.index(stop) > 0
    reference = _answer(plain, stop=[stop])
    assert reference["choices"][0]["finish_reason"] == "stop"
    assert reference["choices"][0]["message"]["content"] == text[:text.index(stop)]
    whole, gained = _gained_during(engine, lambda: _answer(app, stop=[stop]))
    assert gained["spec_accepted_tokens"] > 0
    # the verify steps made more tokens (kept drafts + the target's own) than the answer has after its first:
    # the stop string ended it inside a run, whose tokens after the stop were dropped
    made = gained["spec_accepted_tokens"] + gained["spec_verified_requests"]
    assert made > whole["usage"]["completion_tokens"] - 1, (made, whole["usage"])
    assert whole["choices"][0] == reference["choices"][0]
    assert whole["usage"] == reference["usage"]
    (chunks, usage), kept = _kept_during(engine, lambda: _streamed(app, stop=[stop]))
    assert kept > 0
    assert "".join(c["delta"].get("content") or "" for c in chunks) == text[:text.index(stop)]
    assert [c["finish_reason"] for c in chunks if c["finish_reason"]] == ["stop"]
    assert usage == reference["usage"]


@pytest.mark.parametrize("max_tokens", [7, 13])  # where a full run of 5 would pass max_tokens
def test_max_tokens_mid_run_gives_exactly_max_tokens(spec, plain, max_tokens):
    engine, app = spec
    reference = _answer(plain, max_tokens=max_tokens)
    whole, kept = _kept_during(engine, lambda: _answer(app, max_tokens=max_tokens, logprobs=True))
    assert kept > 0
    assert whole["usage"]["completion_tokens"] == len(whole["choices"][0]["logprobs"]["content"]) == max_tokens
    assert whole["usage"] == reference["usage"]
    assert whole["choices"][0]["message"] == reference["choices"][0]["message"]
    assert whole["choices"][0]["finish_reason"] == "length"
    (chunks, usage), _ = _kept_during(engine, lambda: _streamed(app, max_tokens=max_tokens))
    assert usage["completion_tokens"] == max_tokens
    assert "".join(c["delta"].get("content") or "" for c in chunks) == reference["choices"][0]["message"]["content"]


def _metrics(app) -> Dict[str, float]:
    async def get() -> str:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as h:
            r = await h.get("/metrics")
            assert r.status_code == 200
            return r.text
    samples = {}
    for line in asyncio.run(get()).splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


def test_metrics_report_the_acceptance(spec, plain):
    engine, app = spec
    _, kept = _kept_during(engine, lambda: _answer(app, max_tokens=8))
    assert kept > 0
    s = engine.stats()
    m = _metrics(app)
    assert m["minisrv_spec_accept_rate"] == pytest.approx(s["spec_accepted_tokens"] / s["spec_draft_tokens"])
    assert m["minisrv_spec_accept_length"] == pytest.approx(
        (s["spec_accepted_tokens"] + s["spec_verified_requests"]) / s["spec_verified_requests"])
    assert 0 < m["minisrv_spec_accept_rate"] <= 1
    assert 1 < m["minisrv_spec_accept_length"] <= NUM_DRAFT_TOKENS
    assert _metrics(plain).get("minisrv_spec_accept_rate", 0.0) == 0.0  # nothing speculated there
