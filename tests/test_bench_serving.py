"""The serving benchmark's client (scripts/serving_client.py) against a server whose timings are known
(tests/helpers/sse_ticker.py: one token every 10 ms to every stream): split over several processes it gives the
same records and statistics as one process, keeps the Poisson arrival schedule drawn for the whole run, and keeps
--max-concurrency as a cap on the requests in flight over all its processes."""
from __future__ import annotations

import argparse
import math
import random
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("httpx")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))  # the scripts import each other by name, as when run from there

import serving_client  # noqa: E402
from serving_report import latencies  # noqa: E402

STEP_MS = 10.0


@pytest.fixture(scope="module")
def ticker():
    proc = subprocess.Popen([sys.executable, "-m", "tests.helpers.sse_ticker", "--step-ms", str(STEP_MS)],
                            cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("ready"), line
        yield f"http://127.0.0.1:{line.split()[1]}"
    finally:
        proc.terminate()
        proc.wait(10)


def options(base_url: str, max_concurrency=None, httpx=False) -> argparse.Namespace:
    return argparse.Namespace(base_url=base_url, api_key=None, timeout=60, temperature=0.0, endpoint="completions",
                              max_concurrency=max_concurrency, seed=3, warmup=1, httpx=httpx)


def workload(n: int):
    rng = random.Random(0)
    return [serving_client.Item(f"{i}: some words", rng.randint(8, 24)) for i in range(n)]


@pytest.mark.parametrize("httpx", [False, True], ids=["bare", "httpx"])
def test_several_processes_give_the_statistics_of_one(ticker, httpx):
    items = workload(48)
    runs = {}
    for processes in (1, 3):
        results, duration, cpu = serving_client.run_requests(options(ticker, httpx=httpx), "ticker", items, math.inf,
                                                             processes)
        assert all(r.ok for r in results), [r.error for r in results if not r.ok]
        assert [r.output_tokens for r in results] == [item.max_tokens for item in items]  # in request order
        assert [len(r.itl) for r in results] == [item.max_tokens - 1 for item in items]
        assert cpu > 0
        assert duration >= max(r.e2e for r in results)
        runs[processes] = latencies(results)
    for stats in runs.values():  # what the server does: a token every step to every stream
        assert stats["itl_ms"]["p50"] == pytest.approx(STEP_MS, abs=3)
        assert stats["tpot_ms"]["mean"] == pytest.approx(STEP_MS, abs=3)
    one, three = runs[1], runs[3]
    assert one["output_tokens"] == three["output_tokens"] == sum(item.max_tokens for item in items)
    for key in ("ttft_ms", "e2e_ms"):
        assert three[key]["p50"] == pytest.approx(one[key]["p50"], abs=2 * STEP_MS)


def test_the_poisson_schedule_is_kept_across_processes(ticker):
    rate, n = 20.0, 24
    rng = random.Random(3)  # the reference: exponential gaps from Random(seed), the first request at 0
    expected = [0.0]
    for _ in range(n - 1):
        expected.append(expected[-1] + rng.expovariate(rate))
    assert serving_client.arrival_offsets(n, rate, 3) == pytest.approx(expected)
    assert serving_client.arrival_offsets(4, math.inf, 3) == [0.0] * 4
    results, duration, _ = serving_client.run_requests(options(ticker), "ticker", workload(n), rate, 2)
    assert all(r.ok for r in results)
    late = [res.start - at for res, at in zip(results, expected)]  # sent on the shared schedule, by either process
    assert all(-0.005 < x < 0.06 for x in late), late  # gaps of 50 ms on average: a schedule of its own is off
    assert sorted(late)[n // 2] < 0.015, late
    assert duration >= expected[-1]


def test_max_concurrency_caps_the_requests_in_flight_over_all_processes(ticker):
    results, _, _ = serving_client.run_requests(options(ticker, max_concurrency=4), "ticker", workload(24),
                                                math.inf, 3)
    assert all(r.ok for r in results)
    edges = sorted([(r.start, 1) for r in results] + [(r.start + r.e2e, -1) for r in results])
    in_flight, most = 0, 0
    for _, step in edges:
        in_flight += step
        most = max(most, in_flight)
    assert 3 <= most <= 4
