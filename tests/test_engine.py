"""The engine loop: pages and table rows are accounted for at every step (no slot handed out twice, nothing
leaked), aborts while waiting / mid-prefill / mid-decode / after retraction / with a token in flight free everything
at once, and requests arriving and leaving at random keep every other request's output equal to HF's. Failing
steps: test_engine_faults.py; requests refused or bounded: test_engine_requests.py."""
from __future__ import annotations

import random

import pytest

from minisrv.engine.request import RequestStatus
from minisrv.engine.scheduler import MIN_NEW_TOKEN_RATIO

from .helpers import EngineWatch, assert_greedy_matches, greedy, hf_greedy, make_llm, make_prompts, vocab_of


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("qwen3")


def _check_against_hf(path, req, what=""):
    """A finished request's output equals HF greedy (a prefix of it for an aborted request)."""
    ref, scores = hf_greedy(path, req.prompt_ids, req.max_new_tokens)
    assert_greedy_matches(req.output_ids, ref[:len(req.output_ids)], scores, what or req.rid)


def test_abort_waiting_and_mid_decode(model):
    llm = make_llm(model, max_running_requests=1, page_size=4)
    eng = llm.engine
    watch = EngineWatch(eng)
    prompts = make_prompts(vocab_of(model), [10, 7, 13], seed=30)
    a, b, c = (eng.add_request(p, greedy(10)) for p in prompts)
    eng.step()  # a is prefilled (and samples its first token); b and c wait
    assert a.status is RequestStatus.RUNNING and b.status is RequestStatus.WAITING
    free_before = eng.parts.allocator.num_free
    out = eng.abort(b.rid)
    assert out.finished and out.finish_reason == "abort" and out.rid == b.rid
    assert b.finished and b.finish_reason == "abort" and b not in eng.scheduler.waiting
    assert eng.parts.allocator.num_free == free_before  # it held nothing
    for _ in range(4):
        eng.step()
    assert len(a.output_ids) == 5 and a.num_cached > 0
    held = len(a.pages)
    free_before = eng.parts.allocator.num_free
    out = eng.abort(a.rid)
    assert out.finish_reason == "abort" and out.num_output_tokens == 5
    assert eng.parts.allocator.num_free == free_before + held and not a.pages and a.row == -1
    watch.check()
    # the one left runs to the end and is unaffected
    while eng.has_work():
        eng.step()
    assert c.finished and c.finish_reason == "length"
    _check_against_hf(model, c)
    _check_against_hf(model, a, what="aborted a (prefix)")
    watch.assert_idle()
    # aborting again, or an unknown id, does nothing
    assert eng.abort(a.rid) is None and eng.abort(c.rid) is None and eng.abort("no-such-request") is None
    watch.assert_idle()


def test_abort_mid_chunked_prefill(model):
    llm = make_llm(model, chunked_prefill_size=8, max_prefill_tokens=8, page_size=3)
    eng = llm.engine
    watch = EngineWatch(eng)
    long, short = make_prompts(vocab_of(model), [40, 6], seed=31)
    r = eng.add_request(long, greedy(5))
    s = eng.add_request(short, greedy(5))
    eng.step()
    eng.step()
    assert r.num_cached == 16 and not r.output_ids and r.pages
    eng.abort(r.rid)
    watch.check()
    assert not r.pages
    while eng.has_work():
        eng.step()
    _check_against_hf(model, s)
    watch.assert_idle()


@pytest.mark.slow
def test_abort_after_retraction(model):
    """A retracted request waits with output but no pages; aborting it then is clean, the rest still match HF."""
    llm = make_llm(model, max_total_tokens=48, page_size=2)
    eng = llm.engine
    eng.scheduler.new_token_ratio = MIN_NEW_TOKEN_RATIO
    watch = EngineWatch(eng)
    prompts = make_prompts(vocab_of(model), [12, 10, 14, 9], seed=32)
    reqs = [eng.add_request(p, greedy(20)) for p in prompts]
    victim = None
    for _ in range(500):
        eng.step()
        victim = next((r for r in eng.scheduler.waiting if r.output_ids), None)
        if victim is not None:
            break
    assert victim is not None, "nothing was retracted"
    assert eng.scheduler.num_retractions > 0 and not victim.pages and victim.row == -1
    eng.abort(victim.rid)
    watch.check()
    while eng.has_work():
        eng.step()
    for r in reqs:
        _check_against_hf(model, r)
    assert victim.finish_reason == "abort" and 0 < len(victim.output_ids) < 20
    assert sum(r.finish_reason == "length" for r in reqs) == 3
    watch.assert_idle()


@pytest.mark.parametrize("seed,page_size,pool,chunk", [(0, 1, 48, 8192), (2, 3, 51, 8), (6, 16, 64, 16),
                                                        (3, 2, 48, 5)])
@pytest.mark.slow
def test_random_arrivals_and_aborts(model, seed, page_size, pool, chunk):
    """Requests arrive while others run, some are aborted at random moments, the pool is small enough to retract:
    after every step the bookkeeping holds; every request that ran to the end equals HF greedy, every aborted
    one a prefix of it; at the end the pool is entirely free."""
    rng = random.Random(seed)
    llm = make_llm(model, page_size=page_size, max_total_tokens=pool, chunked_prefill_size=chunk,
                   max_prefill_tokens=max(chunk, 16), max_running_requests=6)
    eng = llm.engine
    eng.scheduler.new_token_ratio = MIN_NEW_TOKEN_RATIO
    watch = EngineWatch(eng)
    vocab = vocab_of(model)
    pending = [(rng.randrange(0, 30), make_prompts(vocab, [rng.randint(1, 30)], seed=seed * 100 + i)[0],
                rng.randint(1, 16)) for i in range(14)]
    reqs, aborted = [], set()
    step = 0
    while pending or eng.has_work():
        for item in [x for x in pending if x[0] <= step]:
            pending.remove(item)
            reqs.append(eng.add_request(item[1], greedy(item[2])))
        live = [r for r in reqs if not r.finished]
        if live and rng.random() < 0.08:
            victim = rng.choice(live)
            assert eng.abort(victim.rid).finish_reason == "abort"
            aborted.add(victim.rid)
            watch.check()
        eng.step()
        step += 1
        assert step < 2000
    assert len(reqs) == 14 and aborted and eng.scheduler.num_retractions > 0
    for r in reqs:
        assert r.finished
        if r.rid in aborted:
            assert r.finish_reason == "abort"
        else:
            assert r.finish_reason == "length" and len(r.output_ids) == r.max_new_tokens
        _check_against_hf(model, r)
    watch.check_logits(model)
    watch.assert_idle()


@pytest.mark.slow
def test_abort_with_overlap_scheduling(model):
    """With overlap on, a request aborted while its newest token is still in flight keeps only real tokens and
    frees its pages; the others finish exactly as HF would have it."""
    llm = make_llm(model, page_size=2)
    eng = llm.engine
    eng.overlap = True
    watch = EngineWatch(eng)
    prompts = make_prompts(vocab_of(model), [9, 14, 5], seed=33)
    a, b, c = (eng.add_request(p, greedy(10)) for p in prompts)
    for _ in range(4):
        eng.step()
    assert eng.runner.num_inflight == 1 and a.num_pending == 1  # a token is on its way
    out = eng.abort(a.rid)
    kept = list(a.output_ids)
    assert out.finish_reason == "abort" and kept and out.num_output_tokens == len(kept)
    assert not a.pages and a.row == -1
    while eng.has_work():
        eng.step()
    assert a.output_ids == kept and a.num_pending == 0  # the token in flight never lands
    for r in (b, c):
        assert r.finished and r.finish_reason == "length" and len(r.output_ids) == 10
        _check_against_hf(model, r)
    watch.assert_idle()
