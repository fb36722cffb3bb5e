"""Prompt logprobs (SamplingParams.prompt_logprobs, echo + logprobs on the server): each prompt token's logprob and
top-n alternatives equal HF transformers' log-softmax at the position before it, in steps, in chunks of scoring
rows, with chunked prefill and with part of the prompt in the prefix cache; max_tokens 0 scores without generating."""
from __future__ import annotations

import pytest
import torch

import minisrv.engine.prompt_scores as prompt_scores
import minisrv.engine.scheduler.prefill as prefill
from minisrv import SamplingParams
from minisrv.engine.request import RequestError

from .helpers import assert_pool_free, greedy, hf_logits, make_llm, make_prompts, vocab_of

MODES = {
    "plain": dict(page_size=1),
    "chunked_small_rows": dict(page_size=3, chunked_prefill_size=8, max_prefill_tokens=16, rows=5),
    "cache": dict(page_size=2, disable_radix_cache=False),
}


def _check(path, prompt, got, top_n, tol=1e-4):
    ref = torch.log_softmax(hf_logits(path, prompt).double(), dim=-1)  # [P, V]
    assert got[0] is None and len(got) == len(prompt)
    for p in range(1, len(prompt)):
        lp = got[p]
        assert lp.token_id == prompt[p]
        want = ref[p - 1, prompt[p]].item()
        assert abs(lp.logprob - want) < tol, (p, lp.logprob, want)
        if top_n:
            vals, ids = ref[p - 1].topk(top_n)
            assert sorted(lp.top) == sorted(ids.tolist())
            for t, v in zip(ids.tolist(), vals.tolist()):
                assert abs(lp.top[t] - v) < tol


@pytest.mark.parametrize("mode", list(MODES))
def test_prompt_logprobs_match_hf(tiny_model, monkeypatch, mode):
    path = tiny_model("qwen2")
    kw = dict(MODES[mode])
    if "rows" in kw:
        monkeypatch.setattr(prompt_scores, "PROMPT_LOGPROB_ROWS", kw.pop("rows"))
    llm = make_llm(path, **kw)
    prompts = make_prompts(vocab_of(path), [23, 40, 9], seed=21)
    if mode == "cache":  # half of the first prompt is in the tree: it must still be scored from position 0
        llm.generate(prompts[0][:12], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
        assert llm.engine.cache.num_tokens >= 10
    outs = llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=n) for n in (0, 3, 5)],
                        use_tqdm=False)
    for p, o, n in zip(prompts, outs, (0, 3, 5)):
        _check(path, p, o.prompt_logprobs, n)
        assert len(o.token_ids) == 3
    if mode != "cache":
        assert_pool_free(llm.engine)


def test_max_tokens_zero_scores_the_prompt_only(tiny_model):
    path = tiny_model("llama")
    llm = make_llm(path, page_size=2)
    prompt = make_prompts(vocab_of(path), [17], seed=22)[0]
    out = llm.generate(prompt, SamplingParams(max_tokens=0, prompt_logprobs=2), use_tqdm=False)[0]
    assert out.token_ids == [] and out.text == "" and out.finish_reason == "length"
    _check(path, prompt, out.prompt_logprobs, 2)
    assert_pool_free(llm.engine)
    with pytest.raises(RequestError, match="max_tokens 0"):
        SamplingParams(max_tokens=0)


def test_a_long_prompt_being_scored_lets_a_short_request_run_between_its_chunks(tiny_model, monkeypatch):
    """A long prompt scored (max_tokens 0) and a 2-token request queued with it: the scoring goes SCORING_CHUNK
    tokens a step with decode steps between, so the short request finishes while the long one is still being
    scored, with the tokens it gets alone; the long prompt's logprobs are HF's."""
    monkeypatch.setattr(prefill, "SCORING_CHUNK", 64)
    path = tiny_model("llama")
    long_p, short_p = make_prompts(vocab_of(path), [400, 8], seed=23)
    alone = make_llm(path).generate(short_p, greedy(2), use_tqdm=False)[0].token_ids
    eng = make_llm(path).engine  # the default chunked prefill size (8192): only a scoring request is chunked
    long_r = eng.add_request(long_p, SamplingParams(max_tokens=0, prompt_logprobs=1))
    short_r = eng.add_request(short_p, greedy(2))
    steps, scored, outs = 0, [], {}
    while eng.has_work():
        before = long_r.num_cached
        outs.update((o.rid, o) for o in eng.step())
        steps += 1
        scored.append(long_r.num_cached - before)
        if short_r.finished and "short" not in outs:
            outs["short"] = (steps, long_r.finished)
    assert outs["short"] == (2, False)  # prefill beside the first chunk, then one decode step between chunks
    assert short_r.output_ids == alone
    assert max(scored) <= 64 and long_r.finished
    _check(path, long_p, outs[long_r.rid].prompt_logprobs, 1)
    assert_pool_free(eng)
