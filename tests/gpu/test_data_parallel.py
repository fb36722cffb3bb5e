"""Data parallelism on a two-GPU host: `--dp-size 2` runs one engine replica a GPU behind the one HTTP server; its
greedy answers equal one replica's (dp 1, one request at a time on both sides so that the batches, and so the
kernels, are the same), each replica fills its own GPU, independent requests sent at once go to both replicas, and
/health reports both ok."""
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from ..helpers.server_process import running
from .common import CKPT, mixed_prompts, requires_ckpt

httpx = pytest.importorskip("httpx")

pytestmark = [requires_ckpt, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")]
ARGS = ("--model", CKPT, "--dtype", "bfloat16", "--device", "cuda")


def _complete(url: str, prompt) -> str:
    body = {"prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    r = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_dp2_answers_as_dp1_on_its_own_gpus_and_spreads_requests():
    prompts = mixed_prompts(6, 5, 300, seed=11)
    with running(*ARGS) as one:
        expected = [_complete(one.url, p) for p in prompts]
    with running(*ARGS, "--dp-size", "2") as two:
        assert [_complete(two.url, p) for p in prompts] == expected
        replicas = httpx.get(two.url + "/health", timeout=10).json()["replicas"]
        assert [r["status"] for r in replicas] == ["ok", "ok"], replicas
        for gpu in range(2):  # each replica's weights and KV pool on its own GPU
            free, total = torch.cuda.mem_get_info(gpu)
            assert total - free > 2 * 2**30, f"GPU {gpu} holds {(total - free) / 2**30:.1f} GiB"
        before = [r["sent"] for r in replicas]
        with ThreadPoolExecutor(len(prompts)) as pool:
            list(pool.map(lambda p: _complete(two.url, p[::-1]), prompts))
        sent = [r["sent"] - b for r, b in zip(httpx.get(two.url + "/health", timeout=10).json()["replicas"], before)]
        assert sum(sent) == len(prompts) and min(sent) >= 2, sent
