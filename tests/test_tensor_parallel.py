"""Tensor parallelism on the CPU: two ranks over gloo run the same code as two GPUs over NCCL.

References: HF transformers in float64 (greedy tokens) and the same engine with one rank (tokens of greedy and
seeded sampling, prompt logprobs), on tiny random Llama (llama3 rope, untied head), Qwen2 (qkv bias, tied), Qwen3
(q/k norm), Mistral and mixture-of-experts (Qwen3-MoE, Mixtral, Qwen2-MoE: each expert split by its width)
checkpoints, plus a model with fewer K/V heads than ranks (replicated K/V), one whose vocabulary does not split
evenly (padded), and the models with sliding windows shorter than the prompts (Gemma 2, Gemma 3, Gemma 3 in a
vision-language checkpoint, Mistral).
"""
from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from minisrv import SamplingParams
from minisrv.distributed import TensorParallel, TensorParallelError
from minisrv.models.sharding import ShardingError

from .helpers import (assert_greedy_matches, build_tiny_model, greedy, hf_greedy, make_llm, make_prompts,
                      vocab_of)
from .helpers.server_process import Server, gone, spawned_children

httpx = pytest.importorskip("httpx")

pytestmark = pytest.mark.slow  # spawns tensor-parallel ranks and server processes

VARIANTS = {  # name -> (base architecture, config overrides)
    "llama-1kv": ("llama", dict(num_key_value_heads=1)),  # 1 K/V head, 2 ranks: each rank holds it
    "qwen2-oddvocab": ("qwen2", dict(vocab_size=321)),  # 161 + 160 rows, the last rank padded
}


@pytest.fixture(scope="module")
def tp_model(tiny_model, tmp_path_factory):
    def get(name: str) -> str:
        if name not in VARIANTS:
            return tiny_model(name)
        base, overrides = VARIANTS[name]
        path = str(tmp_path_factory.mktemp(f"tp-{name}"))
        if not os.path.isfile(os.path.join(path, "config.json")):
            build_tiny_model(path, base, seed=7, **overrides)
        return path
    return get


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3", "mistral", "llama-1kv", "qwen2-oddvocab", "qwen3_moe",
                                  "mixtral", "qwen2_moe", "gemma2", "gemma3", "gemma3_mm", "mistral_window"])
def test_two_ranks_give_hf_and_one_rank_tokens(tp_model, name):
    path = tp_model(name)
    prompts = make_prompts(vocab_of(path), [5, 40, 3, 23])
    one = [o.token_ids for o in make_llm(path).generate(prompts, greedy(10), use_tqdm=False)]
    with make_llm(path, tp_size=2) as llm:
        two = [o.token_ids for o in llm.generate(prompts, greedy(10), use_tqdm=False)]
        workers = llm.engine.workers.procs
    assert all(not p.is_alive() and p.exitcode == 0 for p in workers), "ranks left behind after close()"
    assert two == one
    for p, toks in zip(prompts, two):
        ref, scores = hf_greedy(path, p, 10)
        assert_greedy_matches(toks, ref, scores, f"{name}, tp 2")


def test_chunked_prefill_retraction_prefix_cache_sampling_and_prompt_logprobs(tiny_model):
    """A pool small enough to retract, chunks of 16 tokens, the prefix cache on, seeded sampling and prompt
    logprobs: two ranks give what one gives."""
    path = tiny_model("qwen3")
    vocab = vocab_of(path)
    prompts = make_prompts(vocab, [30, 45, 12, 38, 27, 50], seed=9)
    prompts += [prompts[1][:20] + p for p in make_prompts(vocab, [8, 15], seed=10)]  # share a cached prefix
    params = [greedy(40) if i % 2 else SamplingParams(temperature=0.8, top_k=40, seed=100 + i, max_tokens=40,
                                                      ignore_eos=True, prompt_logprobs=2 if i == 2 else None)
              for i in range(len(prompts))]
    opts = dict(max_total_tokens=192, chunked_prefill_size=16, disable_radix_cache=False, max_running_requests=8)
    results = []
    for tp in (1, 2):
        with make_llm(path, tp_size=tp, **opts) as llm:
            outs = llm.generate(prompts, params, use_tqdm=False)
            results.append((outs, llm.engine.scheduler.num_retractions, llm.engine.num_cached_prompt_tokens))
    (one, retr1, cached1), (two, retr2, cached2) = results
    assert retr1 > 0 and retr2 > 0, "the pool was meant to be small enough to retract"
    assert cached1 > 0 and cached2 > 0
    assert [o.token_ids for o in two] == [o.token_ids for o in one]
    lp1, lp2 = one[2].prompt_logprobs, two[2].prompt_logprobs
    assert lp1[0] is None and lp2[0] is None and len(lp1) == len(lp2) == len(prompts[2])
    for a, b in zip(lp1[1:], lp2[1:]):
        assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4
        assert a.top.keys() == b.top.keys() and all(abs(a.top[k] - b.top[k]) < 1e-4 for k in a.top)


def test_a_tp_size_that_does_not_divide_the_heads_is_refused(tiny_model):
    with pytest.raises(ShardingError, match="tp size 3 does not divide its 4 attention heads"):
        make_llm(tiny_model("qwen3"), tp_size=3)
    assert spawned_children(os.getpid()) == [], "refused before any rank was started"


def test_the_fused_all_reduce_asked_for_on_the_cpu_is_refused(tiny_model):
    with pytest.raises(ValueError, match="needs CUDA"):
        make_llm(tiny_model("llama"), tp_size=2, enable_flashinfer_allreduce_fusion=True)
    assert spawned_children(os.getpid()) == [], "refused before any rank was started"


def test_engines_in_one_process_never_reuse_a_process_group_name(tiny_model):
    """torch's symmetric memory keeps per-name state for the life of a process (Rendezvous says why this matters:
    on CUDA a reused name hangs the fused all-reduce's set-up). Each engine's groups get names no earlier engine
    in this process had, and its freshly spawned rank agrees on them (or the group could not form at all)."""
    path = tiny_model("llama")
    prompts = make_prompts(vocab_of(path), [6, 9])
    names = []
    for _ in range(3):
        with make_llm(path, tp_size=2) as llm:
            tp = llm.engine.runner.tp
            names.append({tp.group.group_name, tp.control.group_name})
            assert len(llm.generate(prompts, greedy(3), use_tqdm=False)) == 2
    assert all(len(n) == 2 for n in names) and len(set().union(*names)) == 6, names


def test_a_killed_rank_ends_the_engine_with_an_error_and_no_orphan(tiny_model):
    path = tiny_model("qwen3")
    prompts = make_prompts(vocab_of(path), [6, 9])
    llm = make_llm(path, tp_size=2)
    try:
        assert len(llm.generate(prompts, greedy(4), use_tqdm=False)) == 2
        (rank1,) = llm.engine.workers.procs
        os.kill(rank1.pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(TensorParallelError, match=r"rank 1 \(pid \d+\) exited with code -9"):
            llm.generate(prompts, greedy(4), use_tqdm=False)
        assert time.monotonic() - t0 < 30
        rank1.join(5)
        assert not rank1.is_alive() and gone(rank1.pid)
    finally:
        llm.close()


def _sleep() -> None:
    time.sleep(60)


def test_a_rank_reaped_by_two_threads_is_named_with_its_exit_code():
    """The watcher and a failed step's check may both reap a killed rank at once: the one whose wait finds the child
    already reaped must still name its exit code (it read None before, now and then, under load)."""
    import multiprocessing as mp
    import threading

    from minisrv.engine.tp_workers import _exited
    ctx = mp.get_context("spawn")
    for _ in range(10):
        proc = ctx.Process(target=_sleep, daemon=True)
        proc.start()
        said = []
        threads = [threading.Thread(target=lambda: said.append(_exited(1, proc, 2.0))) for _ in range(2)]
        os.kill(proc.pid, signal.SIGKILL)
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert all(s.endswith("exited with code -9") for s in said), said


def test_server_with_two_ranks_answers_and_a_lost_rank_gives_503s(tiny_model):
    path = tiny_model("qwen3")
    srv = Server("--model", path, "--tp-size", "2", "--attention-backend", "torch", "--dtype", "float32")
    try:
        srv.wait_ready()
        body = {"prompt": [5, 6, 7, 8], "max_tokens": 6, "temperature": 0, "ignore_eos": True}
        r = httpx.post(srv.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        ref, _ = hf_greedy(path, [5, 6, 7, 8], 6)
        assert r.json()["choices"][0]["text"] == "".join(f"t{t}" for t in ref)  # the tokenizer's words
        (engine_pid,) = spawned_children(srv.proc.pid)  # the engine process (spawned)
        (rank1,) = spawned_children(engine_pid)
        os.kill(rank1, signal.SIGKILL)
        deadline = time.monotonic() + 30
        status = None
        while time.monotonic() < deadline:
            status = httpx.post(srv.url + "/v1/completions", json=body, timeout=60).status_code
            if status == 503:
                break
            time.sleep(0.2)
        assert status == 503
        deadline = time.monotonic() + 20
        while not (gone(engine_pid) and gone(rank1)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert gone(engine_pid) and gone(rank1), "the engine or its rank outlived the lost rank"
        assert any("tensor-parallel rank 1" in line for line in srv.lines)
    finally:
        srv.stop()


class _DoublingGroup(TensorParallel):
    """One rank standing for two identical ones: an all-reduce doubles its input, so a partial sum that is
    reduced twice, or never, changes the output."""

    def all_reduce(self, x):
        return x * 2


class _ReferenceFusedNorm:
    """The fused all-reduce + add + RMSNorm's arithmetic in torch, for _DoublingGroup."""

    def __init__(self):
        self.calls = 0

    def fits(self, x):
        return True

    def __call__(self, x, residual, weight, eps):
        self.calls += 1
        s = 2 * x + residual
        h = s.float()  # the norm's statistics in float32, as the kernel and RMSNorm compute them
        return weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(s.dtype), s


UNGUARDED_SCRIPT = """
import sys
from minisrv import LLM
llm = LLM(model=sys.argv[1], tp_size=2, max_total_tokens=256, log_level="warning")  # no __main__ guard
print("generated", llm.generate([[1, 2, 3]], use_tqdm=False))
"""


def test_a_rank_that_dies_before_joining_fails_the_engine_fast_with_the_fix(tiny_model, tmp_path):
    """A script that builds a tensor-parallel engine at module level makes each spawned rank fail as it imports the
    script again: rank 0 says which rank died and the usual fix within 30 s, instead of waiting for the group."""
    import subprocess
    import sys
    script = tmp_path / "unguarded.py"
    script.write_text(UNGUARDED_SCRIPT)
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, str(script), tiny_model("llama")], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    took = time.monotonic() - t0
    assert proc.returncode != 0 and "generated" not in proc.stdout
    assert took < 30, f"took {took:.1f} s"
    assert "rank 1" in proc.stderr and 'if __name__ == "__main__":' in proc.stderr, proc.stderr[-2000:]


def test_closing_the_group_releases_the_all_reduce_buffers_first():
    """destroy_tensor_parallel lets go of the fused all-reduce's peer buffers before the group is torn down, so that a
    later engine in the process starts without them."""
    from minisrv.distributed import destroy_tensor_parallel
    closed = []

    class FusedNorm(_ReferenceFusedNorm):
        def close(self):
            closed.append(self)

    tp = TensorParallel(0, 2)
    fused = tp.fused_norm = FusedNorm()
    destroy_tensor_parallel(tp)
    assert closed == [fused] and tp.fused_norm is None


def _causal_attention(q, k, v, layer_id):
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    o = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                                         is_causal=True)
    return o.transpose(0, 1).reshape(q.shape[0], -1)


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_deferred_all_reduces_meet_the_fused_norm_once_each(tiny_model, name):
    """With a fused all-reduce + norm, o and down return partial sums and each norm after them reduces them: the
    hidden states equal those of the model that all-reduces inside o and down (float64)."""
    from minisrv.checkpoints.loader import ModelBuild, load_model, load_model_args
    path = tiny_model(name)
    args = load_model_args(path)
    ids = torch.tensor([5, 9, 31, 7, 12, 3, 40])
    pos = torch.arange(len(ids))
    hidden = []
    fused = _ReferenceFusedNorm()
    for f in (None, fused):
        group = _DoublingGroup(0, 1)
        group.fused_norm = f
        model = load_model(path, ModelBuild(args, torch.float64, torch.device("cpu"), 64, tp=group)).model
        with torch.no_grad():
            hidden.append(model(ids, pos, _causal_attention))
    assert fused.calls == 2 * args.num_layers  # after every o and down projection, the last down included
    torch.testing.assert_close(hidden[1], hidden[0], rtol=1e-12, atol=1e-12)
