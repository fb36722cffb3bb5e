"""Tensor parallelism across machines, as two nodes on one host: two `launch_server` processes of one rank each
(--tp-size 2 --nnodes 2, gloo), against the same model with one rank and with two ranks on one node (greedy tokens);
a node that never comes, or that dies, ends the other with an error, never a hang. The heartbeat watch
(engine/node_watch.py) on its own, against a TCP store in this process, with short periods."""
from __future__ import annotations

import concurrent.futures
import os
import queue
import signal
import subprocess
import time

import pytest
import torch

from minisrv.config import EngineConfig
from minisrv.engine import node_watch
from minisrv.engine.node_watch import NodeWatch
from minisrv.engine.setup import tp_device

from .helpers import greedy, make_llm, make_prompts, vocab_of
from .helpers.server_process import Server, free_port, gone, spawned_children

httpx = pytest.importorskip("httpx")

JOIN_TIMEOUT_S = 8  # --dist-timeout of the tests where a node is missing


def start_nodes(path: str, *extra: str):
    """Node 1 (its ranks only) and node 0 (the server) of one group; node 0 is returned first."""
    common = ("--model", path, "--tp-size", "2", "--nnodes", "2", "--dist-init-addr", f"127.0.0.1:{free_port()}",
              "--attention-backend", "torch", "--dtype", "float32", *extra)
    node1 = Server(*common, "--node-rank", "1")
    return Server(*common, "--node-rank", "0"), node1


def complete(node0: Server, prompt, max_tokens: int) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    return httpx.post(node0.url + "/v1/completions", json=body, timeout=60)


def wait_exit(node: Server, timeout_s: float, *others: Server) -> int:
    """node's exit code; a node still running after timeout_s fails the test, showing what every node printed."""
    try:
        code = node.proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        pytest.fail(f"still running after {timeout_s:g} s:\n"
                    + "\n---\n".join("".join(n.lines) for n in (node, *others)))
    time.sleep(0.2)  # its last lines
    return code


@pytest.mark.slow
def test_two_nodes_answer_with_the_tokens_of_one_node(tiny_model):
    path = tiny_model("qwen3")
    prompts = make_prompts(vocab_of(path), [5, 40, 3, 23])
    node0, node1 = start_nodes(path)
    try:
        node0.wait_ready()
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:  # batched together
            answers = list(pool.map(lambda p: complete(node0, p, 10), prompts))
        assert all(r.status_code == 200 for r in answers), [r.text for r in answers]
        assert node0.stop() == 0
        assert wait_exit(node1, 30) == 0, "".join(node1.lines)  # node 1 ends with node 0
    finally:
        node0.kill()
        node1.kill()
    one = [o.token_ids for o in make_llm(path).generate(prompts, greedy(10), use_tqdm=False)]
    with make_llm(path, tp_size=2) as llm:
        two = [o.token_ids for o in llm.generate(prompts, greedy(10), use_tqdm=False)]
        expected = [llm.tokenizer.decode(toks, skip_special_tokens=True) for toks in two]
    assert two == one
    assert [r.json()["choices"][0]["text"] for r in answers] == expected


@pytest.mark.slow
@pytest.mark.parametrize("killed", ["node 1", "rank 1", "rank 0"])
def test_a_node_killed_mid_run_ends_the_other_with_an_error(tiny_model, killed):
    """node 1 (SIGKILL: its rank dies with it): node 0's next step fails, the server answers with an error and
    exits 1. Node 1's rank, node 0 idle: node 1 exits 1 and says why in the store, where node 0's watch reads it and
    ends node 0. Node 0's engine (rank 0): node 1 stops its rank and exits 1, saying why."""
    path = tiny_model("qwen3")
    node0, node1 = start_nodes(path)
    try:
        node0.wait_ready()
        assert complete(node0, [5, 6, 7], 4).status_code == 200
        (rank1,) = spawned_children(node1.proc.pid)
        (engine,) = spawned_children(node0.proc.pid)
        t0 = time.monotonic()
        if killed == "node 1":
            node1.proc.kill()
            r = complete(node0, [5, 6, 7], 4)
            assert r.status_code in (500, 503), r.text
            assert wait_exit(node0, 30) == 1
            assert any("tensor-parallel step failed" in line for line in node0.lines), "".join(node0.lines)
        elif killed == "rank 1":
            os.kill(rank1, signal.SIGKILL)
            assert wait_exit(node1, 30, node0) == 1, "".join(node1.lines)
            assert wait_exit(node0, 30, node1) == 1
            assert any("node 1 stopped: tensor-parallel rank 1" in line for line in node0.lines), \
                "".join(node0.lines)
        else:
            os.kill(engine, signal.SIGKILL)
            assert wait_exit(node1, 30) == 1
            assert any("node 1: " in line and "ranks are stopped" in line for line in node1.lines), \
                "".join(node1.lines)
            assert wait_exit(node0, 30) == 1
        assert time.monotonic() - t0 < 30
        deadline = time.monotonic() + 10
        while not (gone(rank1) and gone(engine)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert gone(rank1) and gone(engine), "a rank outlived its group"
    finally:
        node0.kill()
        node1.kill()


@pytest.mark.slow
def test_a_node_that_never_comes_ends_the_other_within_the_timeout(tiny_model):
    """Node 0 without node 1, and node 1 without node 0 (each of its own group): each exits 1 with an error that
    names the rendezvous, soon after --dist-timeout."""
    path = tiny_model("qwen3")
    node0, _ = start_nodes(path, "--dist-timeout", str(JOIN_TIMEOUT_S))
    _.kill()
    _, node1 = start_nodes(path, "--dist-timeout", str(JOIN_TIMEOUT_S))
    _.kill()
    t0 = time.monotonic()
    try:
        assert wait_exit(node0, JOIN_TIMEOUT_S + 40) == 1
        assert wait_exit(node1, JOIN_TIMEOUT_S + 40) == 1
        took = time.monotonic() - t0
    finally:
        node0.kill()
        node1.kill()
    out0, out1 = "".join(node0.lines), "".join(node1.lines)
    assert f"did not all join at tcp://127.0.0.1:" in out0 and f"within {JOIN_TIMEOUT_S} s" in out0, out0[-3000:]
    assert "node 1: " in out1 and "ranks are stopped" in out1, out1[-3000:]
    assert took < JOIN_TIMEOUT_S + 40


@pytest.mark.slow
def test_ranks_wait_for_the_next_step_past_the_collective_timeout(tiny_model):
    """--dist-timeout bounds joining and collectives, not the wait of an idle engine's ranks for rank 0's next
    step (gloo applies a group's timeout to that wait too: the control group has none)."""
    path = tiny_model("qwen3")
    prompts = make_prompts(vocab_of(path), [5, 9])
    with make_llm(path, tp_size=2, dist_timeout=2) as llm:
        first = [o.token_ids for o in llm.generate(prompts, greedy(4), use_tqdm=False)]
        time.sleep(4)
        assert [o.token_ids for o in llm.generate(prompts, greedy(4), use_tqdm=False)] == first


@pytest.fixture
def fast_watch(monkeypatch):
    """(stores, watch): watches that beat every 50 ms and lose a node silent for 0.5 s, against the store in
    `stores` (this process hosts it while the list holds it)."""
    monkeypatch.setattr(node_watch, "HEARTBEAT_S", 0.05)
    monkeypatch.setattr(node_watch, "NODE_SILENT_S", 0.5)
    import torch.distributed as dist
    stores = [dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)]
    port, started = stores[0].port, []

    def watch(node: int, port: int = port, timeout_s: int = 5):
        cfg = EngineConfig(tp_size=2, nnodes=2, node_rank=node, dist_init_addr=f"127.0.0.1:{port}",
                           dist_timeout=timeout_s)
        heard: queue.Queue = queue.Queue()
        started.append(NodeWatch(cfg, heard.put))
        return started[-1], heard

    yield stores, watch
    for w in started:
        w.stop()


def test_the_node_watch_loses_a_silent_node_only_once_it_was_heard(fast_watch):
    _, watch = fast_watch
    _, heard0 = watch(0)
    time.sleep(1.0)  # node 1 not started: its join's timeout decides, not the watch
    assert heard0.empty()
    one, _ = watch(1)
    time.sleep(0.6)
    assert heard0.empty()
    one.stop()
    assert heard0.get(timeout=5) == "node 1 has not been heard from for 0.5 s"


def test_the_node_watch_tells_why_a_node_stopped(fast_watch):
    _, watch = fast_watch
    _, heard0 = watch(0)
    one, heard1 = watch(1)
    time.sleep(0.3)
    one.stop("tensor-parallel rank 1 (pid 7) exited with code -9")
    assert heard0.get(timeout=5) == "node 1 stopped: tensor-parallel rank 1 (pid 7) exited with code -9"
    assert heard1.empty()


def test_the_node_watch_loses_node_0_with_its_store(fast_watch):
    stores, watch = fast_watch
    _, heard1 = watch(1)
    time.sleep(0.3)
    assert heard1.empty()
    stores.clear()  # the store's host ends, as node 0's rank 0 would
    assert heard1.get(timeout=10).startswith("node 0 is gone: its store at 127.0.0.1:")


def test_the_node_watch_reports_a_store_that_never_answers(fast_watch):
    _, watch = fast_watch
    _, heard = watch(1, port=free_port(), timeout_s=1)
    assert "did not answer within 1 s" in heard.get(timeout=10)


def test_multi_node_settings_are_checked_and_gpus_counted_per_node(monkeypatch):
    for kw, what in ((dict(tp_size=3, nnodes=2), "multiple of nnodes"), (dict(tp_size=2, nnodes=2), "host:port"),
                     (dict(tp_size=2, nnodes=2, node_rank=2, dist_init_addr="h:1"), "node_rank"),
                     (dict(tp_size=2, nnodes=2, dist_init_addr="h:1", enable_flashinfer_allreduce_fusion=True),
                      "one node")):
        with pytest.raises(ValueError, match=what):
            EngineConfig(**kw)
    assert EngineConfig(tp_size=4, nnodes=2, node_rank=1, dist_init_addr="10.0.0.1:5000").ranks_per_node == 2
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    cuda = torch.device("cuda")
    assert [tp_device(cuda, r, 2) for r in range(4)] == [torch.device("cuda", i) for i in (0, 1, 0, 1)]
    with pytest.raises(ValueError, match=r"2 tensor-parallel ranks a node from GPU 0 need GPUs 0..1; this machine"):
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
        tp_device(cuda, 0, 2)
