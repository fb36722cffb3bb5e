"""Sampling end to end on a tiny model: seeded streams reproducible and independent of the batch and of retraction,
top-k 1 and top-p 0 equal greedy, presence/frequency penalties against greedy by hand on HF's logits, stop strings,
stop ids and eos where HF stops, logprobs against HF's float64 log-softmax, and logit bias."""
from __future__ import annotations

import json
import os
import shutil
from typing import List, Sequence

import pytest
import torch

from minisrv import SamplingParams
from minisrv.engine.scheduler import MIN_NEW_TOKEN_RATIO

from .helpers import (EngineWatch, assert_greedy_matches, assert_pool_free, greedy, hf_greedy, hf_logits, make_llm,
                      make_prompts, vocab_of)


@pytest.fixture(scope="module")
def qwen2(tiny_model):
    path = tiny_model("qwen2")
    return path, make_llm(path, page_size=4)


def test_seeded_sampling_reproducible(qwen2):
    path, llm = qwen2
    prompts = make_prompts(vocab_of(path), [6, 20], seed=5)
    p = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True, seed=1234)
    a = llm.generate(prompts, p, use_tqdm=False)
    b = llm.generate(prompts, p, use_tqdm=False)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    others = [llm.generate(prompts[0], SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True, seed=s),
                           use_tqdm=False)[0].token_ids for s in (1, 2, 3)]
    assert len({tuple(t) for t in others + [a[0].token_ids]}) == 4, "different seeds gave identical outputs"
    assert a[0].token_ids != hf_greedy(path, prompts[0], 16)[0]
    assert_pool_free(llm.engine)


@pytest.mark.parametrize("overlap", [False, True])
def test_seeded_output_independent_of_batch_and_retraction(tiny_model, overlap):
    """A seeded request gives the same tokens alone and in a mixed batch that is chunked and retracted; with
    overlap scheduling forced on, where the penalised rows' sampling waits for the previous step's collect
    while the next forward is already queued, every request gives the same tokens as with it off."""
    path = tiny_model("qwen2")
    vocab = vocab_of(path)
    target = make_prompts(vocab, [17], seed=8)[0]
    p = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, max_tokens=14, ignore_eos=True, seed=99,
                       frequency_penalty=0.4)
    alone = make_llm(path).generate([target], p, use_tqdm=False)[0].token_ids
    llm = make_llm(path, max_total_tokens=60, page_size=2, chunked_prefill_size=8, max_prefill_tokens=16)
    llm.engine.scheduler.new_token_ratio = MIN_NEW_TOKEN_RATIO
    watch = EngineWatch(llm.engine)
    others = make_prompts(vocab, [30, 5, 25, 11], seed=9)
    oparams = [SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True),
               SamplingParams(temperature=1.5, max_tokens=14, ignore_eos=True, seed=1),
               SamplingParams(temperature=0.7, min_p=0.05, max_tokens=14, ignore_eos=True),
               SamplingParams(temperature=1.0, repetition_penalty=1.2, max_tokens=14, ignore_eos=True, seed=3)]
    prompts = others[:2] + [target] + others[2:]
    outs = llm.generate(prompts, oparams[:2] + [p] + oparams[2:], use_tqdm=False)
    assert llm.engine.scheduler.num_retractions > 0
    assert outs[2].token_ids == alone
    watch.assert_idle()
    if overlap:
        llm.engine.overlap = True
        llm.engine.scheduler.new_token_ratio = MIN_NEW_TOKEN_RATIO
        again = llm.generate(prompts, oparams[:2] + [p] + oparams[2:], use_tqdm=False)
        determined = [0, 1, 2, 4]  # greedy or seeded (row 3 draws from torch's generator)
        assert [again[i].token_ids for i in determined] == [outs[i].token_ids for i in determined]
        assert llm.engine.scheduler.num_retractions > 0
        watch.assert_idle()


def test_top_k_1_equals_greedy(qwen2):
    path, llm = qwen2
    prompts = make_prompts(vocab_of(path), [9, 33], seed=6)
    outs = llm.generate(prompts, SamplingParams(temperature=1.0, top_k=1, max_tokens=12, ignore_eos=True, seed=5),
                        use_tqdm=False)
    for pr, o in zip(prompts, outs):
        ref, scores = hf_greedy(path, pr, 12)
        assert_greedy_matches(o.token_ids, ref, scores, "top_k=1")


def _penalised_greedy_reference(path: str, prompt: List[int], n: int, presence: float, frequency: float):
    """Greedy decoding by hand on HF's float64 logits with OpenAI presence/frequency penalties on the output."""
    seq, out, scores = list(prompt), [], []
    for _ in range(n):
        logits = hf_logits(path, seq)[-1].clone()
        for t in set(out):
            logits[t] -= presence + frequency * out.count(t)
        scores.append(logits)
        tok = int(logits.argmax())
        out.append(tok)
        seq.append(tok)
    return out, torch.stack(scores)


@pytest.mark.parametrize("presence,frequency", [(1.5, 0.0), (0.0, 1.0), (0.5, 0.8), (-1.0, 0.0)])
def test_presence_frequency_penalties_end_to_end(qwen2, presence, frequency):
    path, llm = qwen2
    prompts = make_prompts(vocab_of(path), [5, 24], seed=10)
    outs = llm.generate(prompts, greedy(12, presence_penalty=presence, frequency_penalty=frequency),
                        use_tqdm=False)
    changed = False
    for pr, o in zip(prompts, outs):
        ref, scores = _penalised_greedy_reference(path, pr, 12, presence, frequency)
        assert_greedy_matches(o.token_ids, ref, scores, f"presence {presence} frequency {frequency}")
        changed |= ref != hf_greedy(path, pr, 12)[0]
    assert changed, "penalties never changed the output: the test proves nothing"


def _token_ends(ids: Sequence[int]) -> List[int]:
    """Character offset where each token's text ends in the tiny tokenizer's decoding ("t12t7" ...)."""
    ends, n = [], 0
    for t in ids:
        n += len(f"t{t}") if t >= 3 else 0
        ends.append(n)
    return ends


def test_stop_strings(qwen2):
    path, llm = qwen2
    prompt = make_prompts(vocab_of(path), [10], seed=12)[0]
    full = llm.generate(prompt, greedy(20), use_tqdm=False)[0]
    text = full.text
    assert text == "".join(f"t{t}" for t in full.token_ids if t >= 3)
    ends = _token_ends(full.token_ids)
    cases = [
        text[ends[5] - 2:ends[6] + 2],  # spans three tokens
        text[ends[2]:ends[3]],  # exactly one token's text
        f"t{full.token_ids[9]}",
    ]
    for stop in cases:
        at = text.find(stop)
        out = llm.generate(prompt, greedy(20, stop=stop), use_tqdm=False)[0]
        assert out.finish_reason == "stop"
        assert out.text == text[:at], f"stop {stop!r}"
        # generation ends with the token that completed the stop string
        k = next(i for i, e in enumerate(ends) if e >= at + len(stop))
        assert out.token_ids == full.token_ids[:k + 1]
    # the earliest of several stop strings wins; one that never occurs changes nothing
    s1, s2 = text[ends[7]:ends[8]], text[ends[3]:ends[4]]
    out = llm.generate(prompt, greedy(20, stop=[s1, "zzz", s2]), use_tqdm=False)[0]
    assert out.text == text[:min(text.find(s1), text.find(s2))]
    out = llm.generate(prompt, greedy(20, stop=["zzz"]), use_tqdm=False)[0]
    assert out.finish_reason == "length" and out.text == text and out.token_ids == full.token_ids
    assert_pool_free(llm.engine)


def test_stop_token_ids_and_length(qwen2):
    path, llm = qwen2
    prompt = make_prompts(vocab_of(path), [14], seed=13)[0]
    ref, _ = hf_greedy(path, prompt, 15)
    stop_tok = ref[6]
    j = ref.index(stop_tok)
    with pytest.raises(ValueError, match=r"stop_token_ids must be in \[0, "):
        llm.generate(prompt, greedy(15, stop_token_ids=[stop_tok, 999999]), use_tqdm=False)
    out = llm.generate(prompt, greedy(15, stop_token_ids=[stop_tok, vocab_of(path) - 1]), use_tqdm=False)[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == ref[:j + 1]  # the stop token is reported in the ids...
    assert out.text == "".join(f"t{t}" for t in ref[:j] if t >= 3)  # ...but not in the text
    out = llm.generate(prompt, greedy(7), use_tqdm=False)[0]
    assert out.finish_reason == "length" and out.token_ids == ref[:7]
    out = llm.generate(prompt, greedy(1), use_tqdm=False)[0]
    assert out.finish_reason == "length" and out.token_ids == ref[:1]


@pytest.mark.parametrize("where", ["config.json", "generation_config.json"])
def test_eos_stops_where_hf_stops(tiny_model, tmp_path, where):
    """An extra eos id, in config.json or only in generation_config.json (where HF generate takes it from), ends
    generation exactly where HF generate ends it; ignore_eos runs on."""
    src = tiny_model("mistral")
    prompt = make_prompts(vocab_of(src), [8], seed=14)[0]
    ref, _ = hf_greedy(src, prompt, 12)
    eos = ref[4]
    j = ref.index(eos)
    dst = str(tmp_path / "m")
    shutil.copytree(src, dst)
    cfg_file = os.path.join(dst, where)
    with open(cfg_file) as f:
        cfg = json.load(f)
    cfg["eos_token_id"] = [2, eos]
    with open(cfg_file, "w") as f:
        json.dump(cfg, f)
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(dst, dtype=torch.float64)
    ids = torch.tensor([prompt])
    kw = {"eos_token_id": [2, eos]} if where == "config.json" else {}  # HF reads eos from generation_config
    hf_out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=12,
                         pad_token_id=0, **kw)[0, len(prompt):].tolist()
    assert hf_out == ref[:j + 1]
    llm = make_llm(dst)
    out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)[0]
    assert out.token_ids == hf_out and out.finish_reason == "stop"
    assert out.text == "".join(f"t{t}" for t in ref[:j] if t >= 3)
    out = llm.generate(prompt, greedy(12), use_tqdm=False)[0]
    assert out.token_ids == ref and out.finish_reason == "length"
    assert_pool_free(llm.engine)


def test_logprobs_match_hf(qwen2):
    path, llm = qwen2
    prompts = make_prompts(vocab_of(path), [3, 29], seed=15)
    outs = llm.generate(prompts, greedy(10, logprobs=5), use_tqdm=False)
    for pr, o in zip(prompts, outs):
        assert len(o.logprobs) == len(o.token_ids) == 10
        ref = torch.log_softmax(hf_logits(path, pr + o.token_ids[:-1]), -1)
        for i, (tok, lp) in enumerate(zip(o.token_ids, o.logprobs)):
            pos = len(pr) - 1 + i
            assert lp.token_id == tok
            assert abs(lp.logprob - ref[pos, tok].item()) < 1e-4
            vals = list(lp.top.values())
            assert len(lp.top) == 5 and vals == sorted(vals, reverse=True)
            assert tok in lp.top and lp.top[tok] == max(vals)  # greedy: the chosen token is the top one
            for t, v in lp.top.items():
                assert abs(v - ref[pos, t].item()) < 1e-4
            assert abs(vals[-1] - ref[pos].topk(5).values[-1].item()) < 1e-4  # they are the top 5
    # sampled tokens: the logprob is the model's (untempered) distribution; logprobs=0 gives no top list
    o = llm.generate(prompts[1], SamplingParams(temperature=0.6, max_tokens=10, ignore_eos=True, seed=3, logprobs=0),
                     use_tqdm=False)[0]
    ref = torch.log_softmax(hf_logits(path, prompts[1] + o.token_ids[:-1]), -1)
    for i, (tok, lp) in enumerate(zip(o.token_ids, o.logprobs)):
        assert lp.top == {} and lp.token_id == tok
        assert abs(lp.logprob - ref[len(prompts[1]) - 1 + i, tok].item()) < 1e-4
    assert llm.generate(prompts[0], greedy(3), use_tqdm=False)[0].logprobs is None


def test_top_p_zero_is_greedy_and_logit_bias_moves_the_choice(qwen2):
    """top_p 0 with temperature 1 gives the greedy tokens; a +100 bias forces a token at every step; a -100 bias on
    HF's first greedy token makes the runner-up come first; logprobs stay the model's own (no bias in them)."""
    path, llm = qwen2
    prompt = make_prompts(vocab_of(path), [11], seed=17)[0]
    ref, scores = hf_greedy(path, prompt, 4)
    out = llm.generate(prompt, SamplingParams(temperature=1.0, top_p=0.0, max_tokens=4, ignore_eos=True,
                                              seed=5), use_tqdm=False)[0]
    assert out.token_ids == ref
    forced = vocab_of(path) - 2
    out = llm.generate(prompt, greedy(3, logit_bias={forced: 100.0}), use_tqdm=False)[0]
    assert out.token_ids == [forced] * 3
    runner_up = scores[0].topk(2).indices[1].item()
    out = llm.generate(prompt, greedy(1, logit_bias={ref[0]: -100.0}, logprobs=0), use_tqdm=False)[0]
    assert out.token_ids == [runner_up]
    want = torch.log_softmax(scores[0].double(), dim=-1)[runner_up].item()
    assert abs(out.logprobs[0].logprob - want) < 1e-4
    with pytest.raises(ValueError, match="logit_bias"):
        llm.generate(prompt, greedy(1, logit_bias={vocab_of(path) + 5: 1.0}), use_tqdm=False)
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={3: 101.0})
