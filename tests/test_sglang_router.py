"""minisrv as a worker behind the SGLang Model Gateway (the `sglang-router` package's Rust router): two CPU servers on
the default model and the real router in front, with its cache-aware policy, as docs/data-parallel.md runs them.
The router finds each worker healthy (/health), names the model by the workers' /server_info, and chat requests
sent to it at once are answered by the workers, both of them (prompts that share little go to the less loaded), as
each answers the same request alone."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import List

import pytest

from .helpers.server_process import Server, free_port, running

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

pytestmark = [pytest.mark.slow,  # two server processes and the router
              pytest.mark.skipif(importlib.util.find_spec("sglang_router") is None,
                                 reason="the sglang-router package is not installed (pip install -e '.[test]')")]

ROUTER_START_S = 60
TOPICS = ["the history of the printing press in Europe", "how a refrigerator moves heat out of its box",
          "why the sky looks blue at noon and red at dusk", "the rules of chess for the knight and the bishop"]


def _chat_count(url: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith('minisrv_requests_total{endpoint="/v1/chat/completions",status="200"}'):
            return float(line.split()[1])
    return 0.0


def _ask(client, model: str, topic: str) -> str:
    r = client.chat.completions.create(model=model, temperature=0, max_tokens=8, messages=[
        {"role": "user", "content": f"{topic.capitalize()}. " * 3 + "Explain it in one sentence."}])
    return r.choices[0].message.content


def test_two_workers_behind_the_router_answer_chat() -> None:
    with running() as a, running() as b:
        port = free_port()
        cmd = [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", a.url, b.url,
               "--policy", "cache_aware", "--host", "127.0.0.1", "--port", str(port),
               "--prometheus-port", str(free_port()), "--log-level", "warn"]
        router = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        lines: List[str] = []
        threading.Thread(target=lambda: lines.extend(router.stdout), daemon=True).start()
        try:
            url = f"http://127.0.0.1:{port}"
            model = _served_model(a)
            deadline = time.monotonic() + ROUTER_START_S
            while True:  # up, with both workers registered under the served model's name
                assert router.poll() is None, "".join(lines)
                assert time.monotonic() < deadline, "".join(lines)
                try:
                    if [m["id"] for m in httpx.get(url + "/v1/models", timeout=5).json()["data"]] == [model]:
                        break
                except (httpx.HTTPError, ValueError, KeyError):
                    pass
                time.sleep(0.2)
            via_router = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
            direct = openai.OpenAI(base_url=a.url + "/v1", api_key="unused", max_retries=0, timeout=120)
            with ThreadPoolExecutor(len(TOPICS)) as pool:  # at once: what little they share leaves it to the load
                answers = list(pool.map(lambda t: _ask(via_router, model, t), TOPICS))
            assert answers == [_ask(direct, model, t) for t in TOPICS]
            served = [_chat_count(a.url) - len(TOPICS), _chat_count(b.url)]  # less the direct ones
            assert sum(served) == len(TOPICS) and min(served) >= 1, served
        finally:
            router.terminate()
            try:
                router.wait(20)
            except subprocess.TimeoutExpired:
                router.kill()
                router.wait()


def _served_model(s: Server) -> str:
    return httpx.get(s.url + "/server_info", timeout=10).json()["served_model_name"]
