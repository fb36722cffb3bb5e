"""Data parallelism (`--dp-size`): the dispatcher's choices on engine clients that start no process (fast), then real
servers on the default model: dp 2 answers as dp 1 does and spreads independent requests, a batch sharing a long
prefix stays on one replica (whose prefix cache then serves it), and a replica killed mid-run is reported by /health
while its request ends with an error and the other replica serves on; one that cannot start fails the start."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, Iterator, List

import pytest

from minisrv.config import EngineConfig
from minisrv.engine.request import SamplingParams
from minisrv.server.engine_proc import EngineDead
from minisrv.server.replicas import AFFINITY_SLACK, BLOCK_TOKENS, Replicas

from .helpers.server_process import Server, free_port, running

httpx = pytest.importorskip("httpx")

GREEDY = SamplingParams(temperature=0.0, max_tokens=4)


@pytest.fixture
def replicas() -> Iterator[Replicas]:
    """Three replicas whose engine clients take requests without an engine behind them (nothing is sent)."""
    r = Replicas(EngineConfig(tp_size=2, base_gpu_id=1, seed=7), 3)
    for c in r.clients:
        c.ready = True
    yield r
    asyncio.run(r.shutdown())


def _holder(r: Replicas, rid: str) -> int:
    (held,) = [i for i, c in enumerate(r.clients) if rid in c._routes]
    return held


def _send(r: Replicas, rid: str, ids: List[int]) -> int:
    r.submit(rid, ids, GREEDY, asyncio.Queue(), rid)
    return _holder(r, rid)


def test_each_replica_gets_its_own_gpus_and_seed(replicas) -> None:
    assert [(c.cfg.base_gpu_id, c.cfg.seed) for c in replicas.clients] == [(1, 7), (3, 8), (5, 9)]


def test_independent_prompts_go_to_the_least_loaded_in_turn(replicas) -> None:
    short = [[i, i + 1] for i in range(6)]  # shorter than a block: no prefix to follow
    assert sorted(_send(replicas, f"a{i}", ids) for i, ids in enumerate(short[:3])) == [0, 1, 2]
    replicas.abort("a0")
    replicas.abort("a1")
    held = _holder(replicas, "a2")
    assert {_send(replicas, "b0", short[3]), _send(replicas, "b1", short[4])} == {0, 1, 2} - {held}
    assert _send(replicas, "b2", short[5]) in {0, 1, 2}  # all equal again
    assert sum(replicas.sent) == 6


def test_a_shared_prefix_follows_its_replica_until_that_one_is_much_busier(replicas) -> None:
    prefix = list(range(1000, 1000 + 3 * BLOCK_TOKENS))
    first = _send(replicas, "p0", prefix + [1])
    for i in range(1, AFFINITY_SLACK):  # the others stay idle: the prefix wins until the slack is used up
        assert _send(replicas, f"p{i}", prefix + [i + 1]) == first
    assert _send(replicas, "over", prefix + [99]) != first


def test_the_longest_remembered_prefix_wins(replicas) -> None:
    short = list(range(2 * BLOCK_TOKENS))
    longer = short + list(range(5000, 5000 + 2 * BLOCK_TOKENS))
    a = _send(replicas, "short", short)
    replicas.index.record(replicas.index.keys(longer)[2:], (a + 1) % 3)  # the longer prompt went elsewhere since
    assert _send(replicas, "longer", longer + [7]) == (a + 1) % 3
    assert _send(replicas, "short2", short + [9]) == (a + 1) % 3  # its blocks were recorded for the last choice


def test_a_dead_replica_gets_nothing_and_its_prefixes_are_forgotten(replicas) -> None:
    prefix = list(range(2 * BLOCK_TOKENS))
    first = _send(replicas, "p", prefix)
    replicas.clients[first].dead = True
    replicas._died(first)
    assert first not in replicas.index.owner.values()
    assert all(_send(replicas, f"q{i}", prefix + [i]) != first for i in range(4))
    for c in replicas.clients:
        c.dead = True
    with pytest.raises(EngineDead):
        replicas.submit("none", prefix, GREEDY, asyncio.Queue(), None)


def test_stats_and_health_over_the_live_replicas(replicas) -> None:
    for i, c in enumerate(replicas.clients):
        c.stats = {"num_running": i, "kv_pages_used": 10 * i, "kv_pages_total": 100, "kv_usage": 0.1 * i}
    replicas.clients[2].dead = True
    assert replicas.stats == {"num_running": 1, "kv_pages_used": 10, "kv_pages_total": 200, "kv_usage": 0.05}
    health = replicas.health()
    assert health["status"] == "degraded" and [r["status"] for r in health["replicas"]] == ["ok", "ok", "dead"]
    one = Replicas(EngineConfig())
    assert one.health() == {"status": "ok"}  # one engine: /health as it always was
    asyncio.run(one.shutdown())


# ---- real servers -------------------------------------------------------------------------------------------------

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land", "1, 2, 3, 4,",
           "The best way to learn a language is", "Water boils at", "My favourite colour is", "import numpy as"]
SHARED = ("You are a careful assistant. Answer briefly and precisely, citing the rule you use. " * 6)


def _complete(url: str, prompt: str, max_tokens: int = 12, **extra) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}
    return httpx.post(url + "/v1/completions", json=body, timeout=180)


def _all(url: str, prompts: List[str], **kw) -> List[str]:
    with ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(lambda p: _complete(url, p, **kw), prompts))
    assert all(r.status_code == 200 for r in answers), [r.text for r in answers]
    return [r.json()["choices"][0]["text"] for r in answers]


def _replicas(url: str) -> List[Dict]:
    r = httpx.get(url + "/health", timeout=10)
    return r.json()["replicas"]


def _cached_tokens(url: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith("minisrv_cached_prompt_tokens_total "):
            return float(line.split()[1])
    raise AssertionError("no minisrv_cached_prompt_tokens_total")


@pytest.fixture(scope="module")
def dp1_answers() -> List[str]:
    with running() as s:
        return _all(s.url, PROMPTS)


@pytest.fixture(scope="module")
def dp2() -> Iterator[Server]:
    with running("--dp-size", "2") as s:
        yield s


@pytest.mark.slow
def test_dp2_answers_as_dp1_and_spreads_requests(dp1_answers, dp2) -> None:
    before = [r["sent"] for r in _replicas(dp2.url)]
    assert _all(dp2.url, PROMPTS) == dp1_answers
    sent = [r["sent"] - b for r, b in zip(_replicas(dp2.url), before)]
    assert sum(sent) == len(PROMPTS) and min(sent) >= 2, sent
    metrics = httpx.get(dp2.url + "/metrics", timeout=30).text
    assert 'minisrv_replica_up{replica="1"} 1.0' in metrics and "minisrv_replica_requests_running" in metrics


@pytest.mark.slow
def test_a_batch_sharing_a_long_prefix_lands_on_one_replica(dp2) -> None:
    before = [r["sent"] for r in _replicas(dp2.url)]
    questions = [f"Question {i}: what is {i} + {i}?" for i in range(6)]
    _all(dp2.url, [SHARED + q for q in questions], max_tokens=4)
    sent = [r["sent"] - b for r, b in zip(_replicas(dp2.url), before)]
    assert sorted(sent) == [0, len(questions)], sent
    cached = _cached_tokens(dp2.url)  # one more, alone: it goes there too, and that replica's cache serves it
    _all(dp2.url, [SHARED + "Question 7: what is 7 + 7?"], max_tokens=4)
    assert [r["sent"] - b for r, b in zip(_replicas(dp2.url), before)] == [n + (n > 0) for n in sent]
    assert _cached_tokens(dp2.url) - cached >= 3 * BLOCK_TOKENS


@pytest.mark.slow
def test_a_killed_replica_is_reported_and_its_request_fails_while_the_other_serves() -> None:
    with running("--dp-size", "2") as s:
        long_answers: List[httpx.Response] = []

        def long_request(i: int) -> None:
            long_answers.append(_complete(s.url, f"Count slowly {i}:", max_tokens=200, ignore_eos=True))

        threads = [threading.Thread(target=long_request, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while [r["requests"] for r in _replicas(s.url)] != [1, 1]:
            assert time.monotonic() < deadline, _replicas(s.url)
            time.sleep(0.05)
        victim = _replicas(s.url)[0]["pid"]
        os.kill(victim, signal.SIGKILL)
        killed_at = time.monotonic()
        while not any(r.status_code == 503 for r in long_answers):
            assert time.monotonic() - killed_at < 20, f"the killed replica's request hangs: {long_answers}"
            time.sleep(0.05)
        (failed,) = long_answers
        assert failed.json()["error"]["code"] == "engine_unavailable", failed.text
        health = httpx.get(s.url + "/health", timeout=10)
        assert health.status_code == 200 and health.json()["status"] == "degraded"
        assert [r["status"] for r in health.json()["replicas"]] == ["dead", "ok"]
        assert _all(s.url, PROMPTS[:2], max_tokens=4)  # new requests go to the live replica
        assert _replicas(s.url)[1]["sent"] == 3
        for t in threads:
            t.join(180)
        assert [r.status_code for r in long_answers] == [503, 200], long_answers[1].text


@pytest.mark.slow
def test_a_replica_that_cannot_start_fails_the_start_by_name() -> None:
    base = [sys.executable, "-m", "minisrv.launch_server", "--port", str(free_port())]
    r = subprocess.run(base + ["--dp-size", "0"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--dp-size must be >= 1" in r.stderr, r.stderr
    r = subprocess.run(base + ["--dp-size", "2", "--attention-backend", "fa", "--device", "cpu"],
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 1 and "the engine failed to start: replica 0:" in r.stderr, r.stderr
