"""Tensor parallelism across machines on one two-GPU host: two `launch_server` processes, each a node of one GPU
(CUDA_VISIBLE_DEVICES), over NCCL, against tp 2 on one node (greedy tokens, one request at a time on both sides so
that the batches, and so the kernels, are the same); and a node killed mid-run ends node 0 with an error."""
import pytest
import torch

from minisrv import LLM, SamplingParams

from ..helpers.server_process import Server, free_port
from .common import CKPT, free_cuda, mixed_prompts, requires_ckpt

httpx = pytest.importorskip("httpx")

pytestmark = [requires_ckpt, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")]
N_NEW = 16


def _nodes():
    common = ("--model", CKPT, "--tp-size", "2", "--nnodes", "2", "--dist-init-addr", f"127.0.0.1:{free_port()}",
              "--dtype", "bfloat16", "--device", "cuda", "--dist-timeout", "120")
    node1 = Server(*common, "--node-rank", "1", env={"CUDA_VISIBLE_DEVICES": "1"})
    return Server(*common, "--node-rank", "0", env={"CUDA_VISIBLE_DEVICES": "0"}), node1


def _complete(node0, prompt):
    body = {"prompt": prompt, "max_tokens": N_NEW, "temperature": 0, "ignore_eos": True}
    return httpx.post(node0.url + "/v1/completions", json=body, timeout=120)


def test_two_nodes_of_one_gpu_give_the_tokens_of_tp2_on_one_node():
    prompts = mixed_prompts(4, 5, 200, seed=3)
    node0, node1 = _nodes()
    try:
        node0.wait_ready()
        texts = []
        for p in prompts:
            r = _complete(node0, p)
            assert r.status_code == 200, r.text
            texts.append(r.json()["choices"][0]["text"])
        assert node0.stop() == 0
        assert node1.proc.wait(60) == 0, "".join(node1.lines)
    finally:
        node0.kill()
        node1.kill()
    free_cuda()
    with LLM(model=CKPT, dtype="bfloat16", tp_size=2, max_total_tokens=16384, log_level="warning") as llm:
        params = SamplingParams(temperature=0, max_tokens=N_NEW, ignore_eos=True)
        expected = [llm.tokenizer.decode(llm.generate([p], params, use_tqdm=False)[0].token_ids,
                                         skip_special_tokens=True) for p in prompts]
    free_cuda()
    assert [t.split() for t in texts] == [e.split() for e in expected]  # (the server decodes after the prompt)


def test_a_node_killed_mid_run_ends_node_0_with_an_error():
    node0, node1 = _nodes()
    try:
        node0.wait_ready()
        assert _complete(node0, [5, 6, 7]).status_code == 200
        node1.proc.kill()  # its rank dies with it
        assert _complete(node0, [5, 6, 7]).status_code in (500, 503)
        assert node0.proc.wait(60) == 1, "".join(node0.lines)
    finally:
        node0.kill()
        node1.kill()
    free_cuda()
