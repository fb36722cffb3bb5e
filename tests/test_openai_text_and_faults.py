"""Against real servers: the server's text equals the offline LLM's, alone and in a batch, with a tokenizer that
cleans up spaces; and a request that makes every step it is in raise fails alone (HTTP 500) while the requests
batched with it complete with the same text as when they ran without it."""
from __future__ import annotations

import concurrent.futures as cf
import json

import pytest

from minisrv import SamplingParams

from .helpers import build_tiny_model, make_llm
from .helpers.faulty_server import FAULT_TOKEN
from .helpers.server_process import Server
from .test_text import write_spaced_tokenizer

httpx = pytest.importorskip("httpx")

pytestmark = pytest.mark.slow  # starts server processes


@pytest.fixture(scope="module")
def spaced_model(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("spaced-srv"))
    build_tiny_model(path, "llama", seed=3, vocab_size=16)
    write_spaced_tokenizer(path, 16)
    return path


def _complete(url: str, prompt, max_tokens: int, timeout: float = 120.0) -> httpx.Response:
    return httpx.post(url + "/v1/completions", timeout=timeout, json={
        "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})


def test_server_text_equals_offline_text_with_space_clean_up(spaced_model):
    prompts = [[13, 14, 4, 15], [12, 15, 15]]
    llm = make_llm(spaced_model)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    alone = [llm.generate(p, params, use_tqdm=False)[0].text for p in prompts]
    batch = [o.text for o in llm.generate(prompts, params, use_tqdm=False)]
    srv = Server("--model", spaced_model, "--attention-backend", "torch")
    try:
        srv.wait_ready()
        served = [_complete(srv.url, p, 40).json()["choices"][0]["text"] for p in prompts]
        streamed = []
        for p in prompts:
            with httpx.stream("POST", srv.url + "/v1/completions", timeout=120, json={
                    "prompt": p, "max_tokens": 40, "temperature": 0, "ignore_eos": True, "stream": True}) as r:
                text = ""
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        text += "".join(c["text"] for c in json.loads(line[6:])["choices"])
                streamed.append(text)
    finally:
        assert srv.stop() == 0
    assert alone == batch == served == streamed


def test_a_failing_request_fails_alone(tmp_path):
    bad = FAULT_TOKEN  # every step holding it raises in the engine process (helpers/faulty_server.py)
    srv = Server(module="tests.helpers.faulty_server")
    try:
        srv.wait_ready()
        prompts = [[1, 100 + 7 * i, 200 + i, 300] for i in range(8)]
        before = [_complete(srv.url, p, 12).json()["choices"][0]["text"] for p in prompts]
        with cf.ThreadPoolExecutor(9) as ex:
            futs = [ex.submit(_complete, srv.url, p, 12) for p in prompts]
            poisoned = ex.submit(_complete, srv.url, [1, bad, 5], 12)
            after = [f.result() for f in futs]
            failed = poisoned.result()
        assert failed.status_code == 500 and "injected fault" in failed.json()["error"]["message"]
        assert [r.status_code for r in after] == [200] * 8
        assert [r.json()["choices"][0]["text"] for r in after] == before
        assert httpx.get(srv.url + "/health", timeout=10).status_code == 200
    finally:
        assert srv.stop() == 0
