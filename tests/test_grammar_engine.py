"""Grammar-constrained requests in the engine on a tiny Qwen3 with a word-level tokenizer ("t12" is token 12):
masked greedy choices and logprobs against HF's float64 logits, compiles off the engine's loop (and aborted
while compiling), a constrained request joining an overlapped batch."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from minisrv import SamplingParams
from minisrv.engine.request import RequestStatus

from .helpers import EOS_ID, assert_pool_free, hf_logits, make_llm, make_prompts, vocab_of


@pytest.fixture(scope="module")
def qwen3(tiny_model):
    return tiny_model("qwen3")


TENS = r"(t1[0-9])+"  # tokens 10..19, one or more: then the stop token is allowed too


def test_masked_greedy_and_logprobs_against_hf(qwen3):
    """Each greedy token is HF's float64 argmax over the tokens the regex allows there (by hand: 10..19, and the
    stop token once one is out), and its logprobs are of HF's raw distribution."""
    llm = make_llm(qwen3)
    prompts = make_prompts(vocab_of(qwen3), [6, 11, 4], seed=7)
    sp = SamplingParams(temperature=0.0, max_tokens=10, regex=TENS, logprobs=3)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.token_ids and all(10 <= t <= 19 for t in out.token_ids[:-1])
        assert out.finish_reason == ("stop" if out.token_ids[-1] == EOS_ID else "length")
        for i, tok in enumerate(out.token_ids):
            ref = hf_logits(qwen3, prompt + out.token_ids[:i])[-1]
            allowed = list(range(10, 20)) + ([EOS_ID] if i else [])
            best = max(allowed, key=lambda t: ref[t].item())
            gap = ref[best].item() - max(ref[t].item() for t in allowed if t != best)
            assert tok == best or gap < 1e-4, (i, tok, best)
            lp = torch.log_softmax(ref, -1)
            assert abs(out.logprobs[i].logprob - lp[tok].item()) < 1e-4
            top = lp.topk(3)
            assert sorted(out.logprobs[i].top) == sorted(top.indices.tolist())  # raw: not limited to the mask
        assert out.text == "".join(f"t{t}" for t in out.token_ids if t != EOS_ID)
    assert_pool_free(llm.engine)


def test_compile_runs_off_the_loop(qwen3):
    """While a grammar compiles the engine keeps stepping the other requests, and does not admit its request; once
    compiled it is admitted and finishes. A failed compile ends only its own request."""
    llm = make_llm(qwen3)
    eng = llm.engine
    release = threading.Event()
    real = eng.grammar._compile

    def slow_compile(kind, text):
        assert release.wait(30), "never released"
        return real(kind, text)

    eng.grammar._compile = slow_compile
    prompts = make_prompts(vocab_of(qwen3), [5, 9, 7], seed=8)
    plain = eng.add_request(prompts[0], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    constrained = eng.add_request(prompts[1], SamplingParams(temperature=0.0, max_tokens=6, regex=TENS))
    failing = eng.add_request(prompts[2], SamplingParams(temperature=0.0, max_tokens=6, regex="(t1"))
    t0 = time.perf_counter()
    while not plain.finished:
        eng.step()
        assert constrained.status is RequestStatus.WAITING and not constrained.output_ids
        assert not failing.finished
    assert time.perf_counter() - t0 < 20
    assert eng.has_work() and eng.scheduler.num_constrained == 2
    release.set()
    while eng.has_work():
        eng.step()
    assert constrained.finish_reason in ("stop", "length") and all(10 <= t <= 19 for t in constrained.output_ids
                                                                     if t != EOS_ID)
    assert failing.finish_reason == "error"
    assert eng.scheduler.num_constrained == 0 and not eng._compiling
    assert_pool_free(eng)


def test_abort_while_compiling(qwen3):
    llm = make_llm(qwen3)
    eng = llm.engine
    release = threading.Event()
    real = eng.grammar._compile

    def slow_compile(kind, text):
        release.wait(30)
        return real(kind, text)

    eng.grammar._compile = slow_compile
    r = eng.add_request([5, 6, 7], SamplingParams(max_tokens=4, regex=TENS))
    eng.step()
    assert eng.abort(r.rid).finish_reason == "abort"
    release.set()
    while eng.has_work():
        eng.step()
    assert not eng._compiling and eng.scheduler.num_constrained == 0
    assert_pool_free(eng)


def test_grammar_request_joining_an_overlapped_batch(qwen3):
    """With overlap on, a grammar request that arrives while a step is in flight: from then on each step's
    sampling waits for the previous step's tokens on the host (its forward is queued first, then the step in flight
    is read back: when launch returns, at most the new step's token is pending), every request gets the tokens it gets
    with overlap off, and once the grammar request is done a step is launched whole again (two tokens pending)."""
    prompts = make_prompts(vocab_of(qwen3), [7, 12], seed=9)
    plain = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    tens = SamplingParams(temperature=0.0, max_tokens=6, regex=TENS)
    results = {}
    for overlap in (False, True):
        llm = make_llm(qwen3)
        eng = llm.engine
        eng.overlap = overlap
        a = eng.add_request(prompts[0], plain)
        for _ in range(3):
            eng.step()
        assert eng.runner.num_inflight == (1 if overlap else 0)
        b = eng.add_request(prompts[1], tens)
        launches = []  # (grammar request live, steps in flight before, a's tokens pending after) at each launch
        launch = eng.runner.launch

        def watched(sb, *args, _launch=launch, _eng=eng, _a=a, _b=b, **kw):
            live, before = not _b.finished, _eng.runner.num_inflight
            _launch(sb, *args, **kw)
            launches.append((live, before, _a.num_pending))

        eng.runner.launch = watched
        while eng.has_work():
            eng.step()
        if overlap:  # the step in flight is read back before the new one samples
            assert all(n == 1 and pending <= 1 for live, n, pending in launches if live)
            assert any(n == 1 and pending == 2 for live, n, pending in launches if not live)  # plain overlap again
        else:
            assert all(n == 0 and pending <= 1 for _, n, pending in launches)
        results[overlap] = (list(a.output_ids), list(b.output_ids))
        assert all(10 <= t <= 19 for t in b.output_ids if t != EOS_ID) and b.finish_reason in ("stop", "length")
        assert_pool_free(eng)
    assert results[True] == results[False]
