"""The engine loop: pages and table rows are accounted for at every step (no slot handed out twice, nothing
leaked), aborts while waiting / mid-prefill / mid-decode / after retraction free everything at once, requests
arriving and leaving at random keep every other request's output equal to HF's, and bad requests fail clearly
without disturbing the engine."""
from __future__ import annotations

import random

import pytest
import torch

from minisrv import SamplingParams
from minisrv.engine.request import RequestStatus
from minisrv.engine.scheduler import MIN_NEW_TOKEN_RATIO

from .helpers import (EngineWatch, assert_greedy_matches, assert_pool_free, greedy, hf_greedy, make_llm,
                      make_prompts, vocab_of)


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
    free_before = eng.allocator.num_free
    out = eng.abort(b.rid)
    assert out.finished and out.finish_reason == "abort" and out.rid == b.rid
    assert b.finished and b.finish_reason == "abort" and b not in eng.scheduler.waiting
    assert eng.allocator.num_free == free_before  # it held nothing
    for _ in range(4):
        eng.step()
    assert len(a.output_ids) == 5 and a.num_cached > 0
    held = len(a.pages)
    free_before = eng.allocator.num_free
    out = eng.abort(a.rid)
    assert out.finish_reason == "abort" and out.num_output_tokens == 5
    assert eng.allocator.num_free == free_before + held and not a.pages and a.row == -1
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


@pytest.mark.parametrize("seed,page_size,pool,chunk", [(0, 1, 48, 8192), (1, 3, 51, 8), (5, 16, 64, 16),
                                                        (3, 2, 48, 5)])
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


def test_a_step_that_fails_once_is_retried_and_every_request_completes(model):
    """A step that raises does not fail its requests: they are recomputed one at a time and all match HF."""
    llm = make_llm(model, page_size=2)
    eng = llm.engine
    prompts = make_prompts(vocab_of(model), [5, 17, 9], seed=33)
    orig = eng.runner.forward_logits
    calls = {"n": 0}

    def failing(fb):
        calls["n"] += 1
        if calls["n"] == 4:
            raise RuntimeError("injected failure")
        return orig(fb)

    eng.runner.forward_logits = failing
    try:
        outs = llm.generate(prompts, greedy(8), use_tqdm=False)
    finally:
        eng.runner.forward_logits = orig
    assert calls["n"] > 4
    for p, o in zip(prompts, outs):
        ref, scores = hf_greedy(model, p, 8)
        assert_greedy_matches(o.token_ids, ref, scores, "after a failed step")
    assert not eng.has_work()
    assert_pool_free(eng)


def test_a_request_whose_steps_always_fail_fails_alone(model):
    """The request that makes every step it is in raise ends with finish_reason "error" and a message; the others in
    its batches complete with HF's tokens, and the pool ends free."""
    llm = make_llm(model, page_size=2)
    eng = llm.engine
    vocab = vocab_of(model)
    prompts = make_prompts(vocab, [6, 11, 8, 14, 9], seed=44)
    poison = prompts[2]
    orig = eng.runner.step_inputs

    def build(sb):
        if any(r.prompt_ids == poison for r in sb.reqs):
            raise ValueError("injected: this request cannot run")
        return orig(sb)

    eng.runner.step_inputs = build
    watch = EngineWatch(eng)
    try:
        reqs = [eng.add_request(p, greedy(6)) for p in prompts]
        news = {}
        for _ in range(500):
            for out in eng.step():
                news.setdefault(out.rid, []).append(out)
            if not eng.has_work():
                break
    finally:
        eng.runner.step_inputs = orig
    bad = reqs[2]
    assert bad.finish_reason == "error" and news[bad.rid][-1].error and "injected" in news[bad.rid][-1].error
    for p, r in zip(prompts, reqs):
        if r is bad:
            continue
        ref, scores = hf_greedy(model, p, 6)
        assert r.finish_reason == "length"
        assert_greedy_matches(r.output_ids, ref, scores, "beside a failing request")
    watch.assert_idle()


def test_max_tokens_none_runs_to_the_context(model):
    llm = make_llm(model, context_length=32)
    prompt = make_prompts(vocab_of(model), [20], seed=34)[0]
    out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True), use_tqdm=False)[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 12
    ref, scores = hf_greedy(model, prompt, 12)
    assert_greedy_matches(out.token_ids, ref, scores, "max_tokens=None")
    assert_pool_free(llm.engine)


def test_pool_smaller_than_context_bounds_requests(model):
    """A request must fit in the pool: the limit is min(context, pool), and one that fits exactly runs."""
    llm = make_llm(model, max_total_tokens=40, page_size=4)
    vocab = vocab_of(model)
    with pytest.raises(ValueError, match="maximum context length is 40 tokens"):
        llm.generate(make_prompts(vocab, [35], seed=35)[0], greedy(6), use_tqdm=False)
    prompt = make_prompts(vocab, [34], seed=35)[0]
    out = llm.generate(prompt, greedy(6), use_tqdm=False)[0]
    ref, scores = hf_greedy(model, prompt, 6)
    assert_greedy_matches(out.token_ids, ref, scores, "pool-sized request")
    assert_pool_free(llm.engine)


# ---------------------------------------------------------------------------------------------------------------
# bad requests


@pytest.fixture(scope="module")
def small_ctx(model):
    return make_llm(model, context_length=64, page_size=4)


def _serves(llm, model) -> None:
    """The engine still serves: nothing is queued, the pool is free, a normal request matches HF."""
    eng = llm.engine
    assert not eng.has_work() and not eng.scheduler.by_id
    assert_pool_free(eng)
    prompt = make_prompts(vocab_of(model), [12], seed=36)[0]
    out = llm.generate(prompt, greedy(5), use_tqdm=False)[0]
    ref, scores = hf_greedy(model, prompt, 5)
    assert_greedy_matches(out.token_ids, ref, scores, "after a rejected request")
    assert_pool_free(eng)


@pytest.mark.parametrize("prompt,params,error,match", [
    ([[]], dict(), ValueError, "prompt is empty"),
    ("", dict(), ValueError, "prompt is empty"),
    ([[5] * 60], dict(max_tokens=5), ValueError, r"maximum context length is 64 tokens. However, you requested "
                                                 r"65 tokens \(60 in the prompt, 5 for the completion\)"),
    ([[5] * 64], dict(max_tokens=None), ValueError, "maximum context length is 64 tokens. However, your prompt has "
                                                    "64 tokens"),
    ([[5, 6, 100000]], dict(), ValueError, r"token ids must be integers in \[0, 448\)"),
    ([[5, -1]], dict(), ValueError, "token ids must be integers"),
    ([None], dict(), TypeError, "a prompt is a string or a list of token ids"),
])
def test_bad_prompts(small_ctx, model, prompt, params, error, match):
    with pytest.raises(error, match=match):
        small_ctx.generate(prompt, SamplingParams(temperature=0.0, **params), use_tqdm=False)
    _serves(small_ctx, model)


def test_one_bad_prompt_rejects_the_whole_batch_before_queueing(small_ctx, model):
    good = make_prompts(vocab_of(model), [5, 9], seed=37)
    with pytest.raises(ValueError, match="prompt is empty"):
        small_ctx.generate([good[0], good[1], []], greedy(4), use_tqdm=False)
    with pytest.raises(ValueError, match="2 prompts but 3 sampling params"):
        small_ctx.generate(good, [greedy(4)] * 3, use_tqdm=False)
    _serves(small_ctx, model)


@pytest.mark.parametrize("params,match", [
    (dict(max_tokens=0), "max_tokens 0 generates nothing"),
    (dict(max_tokens=-3), "max_tokens must be at least 0"),
    (dict(temperature=-0.5), "temperature must be non-negative"),
    (dict(top_p=-0.1), "top_p must be in"),
    (dict(top_p=1.5), "top_p must be in"),
    (dict(top_k=-2), "top_k must be"),
    (dict(min_p=1.5), "min_p must be in"),
    (dict(presence_penalty=3.0), "presence_penalty"),
    (dict(frequency_penalty=-2.5), "frequency_penalty"),
    (dict(repetition_penalty=0.0), r"repetition_penalty must be in \(0, 100\]"),
    (dict(logprobs=21), "logprobs must be in"),
    (dict(stop=[""]), "stop strings must be non-empty"),
])
def test_bad_sampling_params(small_ctx, model, params, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**params)
    # the same values set after construction are caught when the request is made
    sp = SamplingParams()
    for k, v in params.items():
        setattr(sp, k, v)
    with pytest.raises(ValueError, match=match):
        small_ctx.engine.add_request([5, 6, 7], sp)
    _serves(small_ctx, model)


def test_sampling_params_are_validated_once_per_process(small_ctx, model, monkeypatch):
    """Offline: made and run, a request's values are validated once (at construction), not again when the request
    is checked against the model; a field set afterwards, or a copy that crossed a process boundary (pickled), is
    validated once more when the request is made."""
    import pickle
    calls = []
    validate = SamplingParams.validate
    monkeypatch.setattr(SamplingParams, "validate", lambda self: calls.append(1) or validate(self))
    sp = greedy(3)
    assert len(calls) == 1
    out = small_ctx.generate([5, 6, 7], sp, use_tqdm=False)[0]
    assert len(calls) == 1 and len(out.token_ids) == 3
    sp.max_tokens = 2
    small_ctx.engine.make_request([5, 6, 7], sp)
    small_ctx.engine.make_request([5, 6, 7], sp)
    assert len(calls) == 2
    received = pickle.loads(pickle.dumps(sp))
    assert received == sp
    small_ctx.engine.make_request([5, 6, 7], received)
    small_ctx.engine.make_request([5, 6, 7], received)
    assert len(calls) == 3
    _serves(small_ctx, model)


def test_duplicate_request_id(small_ctx, model):
    eng = small_ctx.engine
    eng.add_request([5, 6, 7], greedy(3), rid="same")
    with pytest.raises(ValueError, match="duplicate request id 'same'"):
        eng.add_request([8, 9], greedy(3), rid="same")
    while eng.has_work():
        eng.step()
    eng.add_request([8, 9], greedy(3), rid="same")  # a finished request's id may be reused
    while eng.has_work():
        eng.step()
    _serves(small_ctx, model)


def test_engine_stats(small_ctx):
    eng = small_ctx.engine
    r = eng.add_request([5, 6, 7, 8, 9], greedy(4))
    st = eng.stats()
    assert st["num_waiting"] == 1 and st["num_running"] == 0 and st["kv_pages_used"] == 0
    eng.step()
    st = eng.stats()
    assert st["num_running"] == 1 and st["kv_pages_used"] == 2  # 5 tokens in pages of 4
    eng.abort(r.rid)
    assert eng.stats()["kv_pages_used"] == 0 and eng.stats()["kv_usage"] == 0.0


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


@pytest.mark.parametrize("page_size", [1, 4])
def test_pool_store_of_adjacent_k_and_v_matches_separate_writes(page_size):
    """K and V that sit side by side in a fused qkv output are stored with one scatter; the pool must end up
    exactly as with two separate writes (and as with k/v that are not adjacent)."""
    from minisrv.kvcache import KVPool
    h, d, t = 2, 8, 5
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(t, (3 + 2 * h) * d, generator=g)  # 3 q heads, then k, then v
    k = qkv[:, 3 * d:(3 + h) * d].view(t, h, d)
    v = qkv[:, (3 + h) * d:].view(t, h, d)
    loc = torch.tensor([7, 0, 13, 2, 9])
    pools = [KVPool(2, 16 // page_size, page_size, h, d, torch.float32, torch.device("cpu")) for _ in range(3)]
    pools[0].store(1, loc, k, v)  # adjacent: the fused path
    pools[1].store(1, loc, k.clone(), v.clone())  # separate tensors: two writes
    flat_k = pools[2].k[1].view(-1, h, d)
    flat_v = pools[2].v[1].view(-1, h, d)
    for i, s in enumerate(loc.tolist()):  # by hand
        flat_k[s] = k[i]
        flat_v[s] = v[i]
    for p in pools[:2]:
        assert torch.equal(p.k[1], pools[2].k[1]) and torch.equal(p.v[1], pools[2].v[1])
        assert not p.k[0].any() and not p.v[0].any()  # other layers untouched
    assert pools[0].v[1].view(-1, h, d)[7].equal(v[0]) and not pools[0].k[1].equal(pools[0].v[1])
