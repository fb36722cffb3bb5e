"""A step that raises does not end the engine: a step that fails once is retried request by request and every
request completes with HF's tokens; a request that makes every step it is in raise fails alone, with its error,
while the others complete. The faults are injected by wrapping the engine's runner."""
from __future__ import annotations

import pytest

from .helpers import (EngineWatch, assert_greedy_matches, assert_pool_free, greedy, hf_greedy, make_llm,
                      make_prompts, vocab_of)


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("qwen3")


def test_a_step_that_fails_once_is_retried_and_every_request_completes(model):
    """A step that raises does not fail its requests: they are recomputed one at a time and all match HF."""
    llm = make_llm(model, page_size=2)
    eng = llm.engine
    prompts = make_prompts(vocab_of(model), [5, 17, 9], seed=33)
    orig = eng.runner.forward_logits
    calls = {"n": 0}

    def failing(*args):
        calls["n"] += 1
        if calls["n"] == 4:
            raise RuntimeError("injected failure")
        return orig(*args)

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
