"""Prompt logprobs (SamplingParams.prompt_logprobs, echo + logprobs on the server): each prompt token's logprob and
top-n alternatives equal HF transformers' log-softmax at the position before it, in steps, in chunks of scoring
rows, with chunked prefill and with part of the prompt in the prefix cache; max_tokens 0 scores without generating."""
from __future__ import annotations

import pytest
import torch

import minisrv.engine.prompt_scores as prompt_scores
from minisrv import SamplingParams
from minisrv.engine.request import RequestError

from .helpers import assert_pool_free, hf_logits, make_llm, make_prompts, vocab_of

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
