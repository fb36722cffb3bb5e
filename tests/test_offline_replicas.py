"""`LLM(dp_size=2)`: two engine replicas in processes of their own serve the offline API. Against one engine (dp 1)
on the same tiny checkpoint: the same greedy tokens, texts and logprobs (prompt logprobs too), in the caller's order,
with the requests spread over both replicas; a batch sharing a long prefix lands on one replica; embeddings equal
one engine's; a refused request raises and the pool serves on; a dead replica's requests raise, not hang."""
from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from minisrv import LLM, SamplingParams
from minisrv.server.replicas import BLOCK_TOKENS

from .helpers import make_prompts, vocab_of
from .test_embeddings import build_embedding_model

pytestmark = pytest.mark.slow
OPTS = dict(attention_backend="torch", dtype="float32", log_level="warning", max_total_tokens=4096)


@pytest.fixture(scope="module")
def model(tiny_model) -> str:
    return tiny_model("qwen3")


@pytest.fixture(scope="module")
def pool(model):
    with LLM(model=model, dp_size=2, **OPTS) as llm:
        yield llm


def test_dp2_gives_one_engines_outputs_in_order_and_spreads_requests(model, pool) -> None:
    prompts = make_prompts(vocab_of(model), [5, 40, 3, 23, 12, 31, 64, 9], seed=3)
    params = [SamplingParams(temperature=0, max_tokens=4 + i, ignore_eos=True, logprobs=2, prompt_logprobs=1)
              for i in range(len(prompts))]
    with LLM(model=model, **OPTS) as one:
        want = one.generate(prompts, params, use_tqdm=False)
    before = list(pool.replicas.replicas.sent)
    t = time.perf_counter()
    got = pool.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t
    sent = [n - b for n, b in zip(pool.replicas.replicas.sent, before)]
    assert sum(sent) == len(prompts) and min(sent) >= 2, sent
    # the call's record (what benchmarks print per replica): each request's replica, as counted, and its end
    assert [sum(r == q for q, _ in pool.replicas.last_call) for r in range(2)] == sent
    assert all(0 < s <= elapsed for _, s in pool.replicas.last_call)
    for w, g in zip(want, got):
        assert (g.token_ids, g.text, g.finish_reason, g.prompt_token_ids) == \
            (w.token_ids, w.text, w.finish_reason, w.prompt_token_ids)
        assert [lp.token_id for lp in g.logprobs] == [lp.token_id for lp in w.logprobs]
        # (a replica's batches hold other requests than one engine's: float32 sums in another order)
        assert all(abs(a.logprob - b.logprob) < 1e-4 for a, b in zip(g.logprobs, w.logprobs))
        assert len(g.prompt_logprobs) == len(w.prompt_logprobs) == len(w.prompt_token_ids)
    # offline replicas start unstaged: built whole before ready, as one engine is (a server's answer at once)
    assert [c.staged for c in pool.replicas.replicas.clients] == [False, False]


def test_a_batch_sharing_a_long_prefix_lands_on_one_replica(model, pool) -> None:
    shared = make_prompts(vocab_of(model), [3 * BLOCK_TOKENS], seed=5)[0]
    tails = make_prompts(vocab_of(model), [4, 7, 2, 9, 5], seed=6)
    before = list(pool.replicas.replicas.sent)
    pool.generate([shared + t for t in tails], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert sorted(n - b for n, b in zip(pool.replicas.replicas.sent, before)) == [0, len(tails)]


def test_a_refused_request_raises_and_the_pool_serves_on(model, pool) -> None:
    ok = make_prompts(vocab_of(model), [6], seed=8)[0]
    with pytest.raises(RuntimeError, match="failed"):
        pool.generate([ok, ok * 1000], SamplingParams(max_tokens=2), use_tqdm=False)  # longer than the context
    assert len(pool.generate([ok], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                             use_tqdm=False)[0].token_ids) == 3


def test_embeddings_equal_one_engines(tmp_path) -> None:
    path = build_embedding_model(str(tmp_path / "emb"), "last")
    inputs = make_prompts(vocab_of(path), [5, 17, 3, 30], seed=2)
    with LLM(model=path, **OPTS) as one:
        want = one.embed(inputs, use_tqdm=False)
    with LLM(model=path, dp_size=2, **OPTS) as two:
        got = two.embed(inputs, use_tqdm=False)
    for w, g in zip(want, got):
        assert torch.allclose(w, g, rtol=1e-4, atol=1e-4)  # (other batches: float32 sums in another order)


def test_the_requests_of_a_dead_replica_raise_not_hang(model) -> None:
    prompts = make_prompts(vocab_of(model), [8] * 6, seed=9)
    with LLM(model=model, dp_size=2, **OPTS) as llm:
        os.kill(llm.replicas.replicas.clients[1].pid, signal.SIGKILL)
        with pytest.raises(RuntimeError, match="failed"):
            llm.generate(prompts, SamplingParams(temperature=0, max_tokens=200, ignore_eos=True), use_tqdm=False)


def test_dp_size_below_one_is_refused(model) -> None:
    with pytest.raises(ValueError, match="dp_size"):
        LLM(model=model, dp_size=0, **OPTS)
