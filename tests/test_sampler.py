"""Sampling: the filters (top-k, top-p, min-p) against hand-computed sets, the Gumbel-max draw against
softmax(logits / T) by a chi-square test, penalties against hand computation and HF's logits processor, seeds,
stop conditions and logprobs end to end on a tiny model (logprobs against HF's float64 log-softmax)."""
from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
from typing import List, Sequence, Set

import pytest
import torch

from minisrv import SamplingParams
from minisrv.engine.request import Request
from minisrv.engine.sampler import SamplingBatch, apply_penalties, filter_mask, hashed_uniform, sample
from minisrv.engine.scheduler import MIN_NEW_TOKEN_RATIO

from .helpers import (EngineWatch, assert_greedy_matches, assert_pool_free, greedy, hf_greedy, hf_logits, make_llm,
                      make_prompts, vocab_of)

# chi-square critical values at p = 1e-6 (deterministic hashes make these tests deterministic; the margin is for
# changes of hash constants, not for flakiness)
CHI2_CRIT = {3: 30.66, 4: 33.38, 5: 35.89, 7: 40.52, 9: 44.81}


def _batch(params: Sequence[SamplingParams], outputs: Sequence[Sequence[int]] = (), prompts=None,
           seeds=None) -> SamplingBatch:
    """A SamplingBatch built the engine's way, from requests; `seeds` gives each request params.seed."""
    reqs = []
    for i, p in enumerate(params):
        if seeds is not None and seeds[i] is not None:
            p = dataclasses.replace(p, seed=seeds[i])
        r = Request(list(prompts[i]) if prompts else [0], p, 100)
        if outputs:
            r.output_ids = list(outputs[i])
        reqs.append(r)
    return SamplingBatch.build(reqs, torch.device("cpu"))


# ---------------------------------------------------------------------------------------------------------------
# filters

SORTED_P = [0.35, 0.25, 0.2, 0.1, 0.06, 0.04]
PERM = [3, 0, 5, 1, 4, 2]  # token PERM[r] has the r-th largest probability


@pytest.mark.parametrize("top_k,top_p,min_p,kept_ranks", [
    (0, 1.0, 0.0, {0, 1, 2, 3, 4, 5}),
    (2, 1.0, 0.0, {0, 1}),
    (1, 1.0, 0.0, {0}),
    (10, 1.0, 0.0, {0, 1, 2, 3, 4, 5}),
    (0, 0.3, 0.0, {0}),  # the top token alone has 0.35 >= 0.3
    (0, 0.5, 0.0, {0, 1}),  # 0.35 < 0.5 <= 0.6
    (0, 0.61, 0.0, {0, 1, 2}),
    (0, 0.85, 0.0, {0, 1, 2, 3}),
    (0, 0.01, 0.0, {0}),
    (0, 1.0, 0.5, {0, 1, 2}),  # p >= 0.175
    (0, 1.0, 0.25, {0, 1, 2, 3}),  # p >= 0.0875
    (0, 1.0, 1.0, {0}),
    # top-p applies to the top-k renormalised: top-3 is [.4375, .3125, .25], so 0.7 keeps two...
    (3, 0.7, 0.0, {0, 1}),
    # ...where top-p 0.7 alone keeps three (0.35 + 0.25 < 0.7)
    (0, 0.7, 0.0, {0, 1, 2}),
    (4, 0.95, 0.3, {0, 1, 2}),  # top-4, top-p keeps all four, min-p (>= 0.105) drops the 0.1
])
def test_filter_mask_known_sets(top_k, top_p, min_p, kept_ranks):
    probs = torch.zeros(1, 6)
    for r, tok in enumerate(PERM):
        probs[0, tok] = SORTED_P[r]
    removed = filter_mask(probs, torch.tensor([top_k]), torch.tensor([top_p]), torch.tensor([min_p]))
    kept = {t for t in range(6) if not removed[0, t]}
    assert kept == {PERM[r] for r in kept_ranks}


@pytest.mark.parametrize("top_p,min_p,kept", [
    (0.5, 0.0, {0}),  # exactly reached by the top token: the smallest set with mass >= top_p
    (0.75, 0.0, {0, 1}),
    (0.875, 0.0, {0, 1, 2}),
    (1.0, 0.25, {0, 1, 2, 3}),  # min-p keeps a token at exactly min_p * max
    (1.0, 0.5, {0, 1}),
])
def test_filter_mask_exact_boundaries(top_p, min_p, kept):
    """Dyadic probabilities, so the boundaries are exact in float32."""
    probs = torch.tensor([[0.125, 0.5, 0.125, 0.25]])
    rank_of = {1: 0, 3: 1, 0: 2, 2: 3}  # tokens 0 and 2 tie at 0.125: the sort decides which is rank 2
    removed = filter_mask(probs, torch.tensor([0]), torch.tensor([top_p]), torch.tensor([min_p]))
    kept_tokens = {t for t in range(4) if not removed[0, t]}
    if kept == {0, 1, 2}:  # one of the tied 0.125 tokens
        assert len(kept_tokens) == 3 and {1, 3} <= kept_tokens
    else:
        assert {rank_of[t] for t in kept_tokens} == kept


def _reference_kept(p: List[float], top_k: int, top_p: float, min_p: float) -> Set[int]:
    """The definitions, one token at a time: top-k; then the smallest prefix (by probability) of the top-k
    renormalised whose mass reaches top_p; then p >= min_p * max p. The top token always stays."""
    order = sorted(range(len(p)), key=lambda t: -p[t])
    keep = order[:top_k] if top_k > 0 else order
    mass = sum(p[t] for t in keep)
    out, acc = [], 0.0
    for t in keep:
        if top_p < 1.0 and acc >= top_p:
            break
        out.append(t)
        acc += p[t] / mass
    top = p[order[0]]
    return {t for t in out if p[t] >= min_p * top} | {order[0]}


def test_filter_mask_random_rows_match_definition():
    g = torch.Generator().manual_seed(0)
    rows, settings = [], []
    rng = random.Random(0)
    for _ in range(64):
        logits = torch.randn(12, generator=g, dtype=torch.float64) * 2
        rows.append(torch.softmax(logits, -1))
        settings.append((rng.choice([0, 0, 1, 3, 5, 20]), rng.choice([1.0, 0.9, 0.5, 0.2, 0.75]),
                         rng.choice([0.0, 0.0, 0.05, 0.2])))
    probs = torch.stack(rows)
    removed = filter_mask(probs.float(), torch.tensor([s[0] for s in settings]),
                          torch.tensor([s[1] for s in settings], dtype=torch.float32),
                          torch.tensor([s[2] for s in settings], dtype=torch.float32))
    for i, (k, tp, mp) in enumerate(settings):
        p = probs[i].tolist()
        expected = _reference_kept(p, k, tp, mp)
        kept = {t for t in range(12) if not removed[i, t]}
        if kept != expected:  # only a boundary within float32 rounding may differ
            sorted_p = sorted(p, reverse=True)
            assert any(abs(sum(sorted_p[:j]) - tp) < 1e-5 for j in range(13)), (i, k, tp, mp, kept, expected)


# ---------------------------------------------------------------------------------------------------------------
# the random stream and the Gumbel-max draw


def test_hashed_uniform_strictly_inside_unit_interval():
    """-log(-log(u)) must stay finite: u == 1 would give a token +inf noise, so it would be picked whatever its
    probability (even when a filter removed it: -inf + inf is NaN, and argmax takes NaN)."""
    vocab = 32768
    for start in range(0, 1024, 256):
        seeds = torch.arange(start, start + 256, dtype=torch.int64)
        u = hashed_uniform(seeds, torch.zeros(256, dtype=torch.int64), vocab)
        assert u.dtype == torch.float32
        assert (u > 0).all() and (u < 1).all(), f"u hits {u.min().item()} / {u.max().item()} for seeds {start}+"
    u = hashed_uniform(torch.full((256,), 7, dtype=torch.int64), torch.arange(256, dtype=torch.int64), vocab)
    assert (u > 0).all() and (u < 1).all()


def test_overwhelming_logit_always_wins():
    """A token 50 nats above all others (the rest share ~1e-17 of the mass) is drawn for every one of 1024 seeds."""
    vocab = 32768
    logits = torch.zeros(256, vocab)
    logits[:, 1234] = 50.0
    for start in range(0, 1024, 256):
        sb = _batch([SamplingParams(temperature=1.0)] * 256, seeds=list(range(start, start + 256)))
        ids, _, _ = sample(logits, sb)
        assert (ids == 1234).all(), f"seeds {[start + i for i in (ids != 1234).nonzero().flatten().tolist()]}"


def test_hashed_uniform_is_a_function_of_seed_step_token():
    seeds = torch.tensor([5, 9, 5, 123456789], dtype=torch.int64)
    steps = torch.tensor([0, 0, 3, 0], dtype=torch.int64)
    u = hashed_uniform(seeds, steps, 100)
    alone = hashed_uniform(torch.tensor([5]), torch.tensor([3]), 100)
    assert torch.equal(u[2], alone[0])
    assert torch.equal(u, hashed_uniform(seeds, steps, 100))
    assert not torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])
    # the first tokens of a larger vocabulary get the same draws
    assert torch.equal(hashed_uniform(seeds, steps, 300)[:, :100], u)


def test_seeds_are_used_in_all_64_bits():
    """Seeds that agree modulo 2**31 or 2**32, and negative seeds, give different streams; each stays in (0, 1)."""
    big = [0, 2 ** 31, 2 ** 32, 2 ** 62 + 7, -(2 ** 63), 2 ** 63 - 1, -1, 1]
    u = hashed_uniform(torch.tensor(big, dtype=torch.int64), torch.zeros(len(big), dtype=torch.int64), 1000)
    assert (u > 0).all() and (u < 1).all()
    for i in range(len(big)):
        for j in range(i):
            assert not torch.equal(u[i], u[j]), f"seeds {big[i]} and {big[j]} give the same draws"


def test_seed_outside_64_bits_is_refused():
    from minisrv.engine.request import RequestError
    for bad in (2 ** 63, 2 ** 70, -(2 ** 63) - 1):
        with pytest.raises(RequestError, match="signed 64-bit"):
            SamplingParams(seed=bad)
    SamplingParams(seed=2 ** 63 - 1)
    SamplingParams(seed=-(2 ** 63))


def _chi2(counts: torch.Tensor, probs: torch.Tensor, n: int) -> float:
    exp = probs.double() * n
    return (((counts.double() - exp) ** 2) / exp).sum().item()


LOGITS8 = torch.tensor([1.0, 0.2, -0.5, 2.0, 0.0, -1.5, 0.7, -0.3])


@pytest.mark.parametrize("seeded", [True, False])
@pytest.mark.parametrize("temperature", [1.0, 0.6, 1.7])
def test_sampling_frequencies_match_softmax_over_seeds(temperature, seeded):
    """Many requests drawing one token from the same logits: seeded rows (the counter hash, one seed per row) and
    unseeded rows (torch's generator) both draw from softmax(logits / T)."""
    n = 40000
    torch.manual_seed(0)
    sb = _batch([SamplingParams(temperature=temperature)] * n, seeds=list(range(n)) if seeded else None)
    ids, _, _ = sample(LOGITS8.repeat(n, 1), sb)
    counts = torch.bincount(ids, minlength=8)
    probs = torch.softmax(LOGITS8.double() / temperature, -1)
    assert _chi2(counts, probs, n) < CHI2_CRIT[7]
    # and it is not the untempered distribution (the test has the power to tell)
    if temperature != 1.0:
        assert _chi2(counts, torch.softmax(LOGITS8.double(), -1), n) > 10 * CHI2_CRIT[7]


def test_sampling_frequencies_match_softmax_over_steps_of_one_seed():
    """One request's stream: successive output positions of a single seed are independent draws."""
    n = 40000
    reqs = []
    for step in range(n):
        r = Request([0], SamplingParams(temperature=0.8, seed=31337), 10)
        r.output_ids = range(step)  # only its length (the step) matters here
        reqs.append(r)
    sb = SamplingBatch.build(reqs, torch.device("cpu"))
    assert sb.steps.tolist() == list(range(n))
    ids, _, _ = sample(LOGITS8.repeat(n, 1), sb)
    counts = torch.bincount(ids, minlength=8)
    assert _chi2(counts, torch.softmax(LOGITS8.double() / 0.8, -1), n) < CHI2_CRIT[7]


@pytest.mark.parametrize("top_k,top_p,min_p,kept", [
    (3, 1.0, 0.0, [3, 0, 6]),
    (0, 0.6, 0.0, [3, 0]),  # sorted probs .464 .171 .127 .077 ...: 0.464 < 0.6 <= 0.635
    (0, 1.0, 0.15, [3, 0, 6, 1]),  # p >= 0.15 * 0.464 = 0.0696
])
@pytest.mark.parametrize("seeded", [True, False])
def test_filtered_sampling_draws_the_renormalised_distribution(top_k, top_p, min_p, kept, seeded):
    n = 30000
    p = torch.softmax(LOGITS8.double(), -1)
    order = p.argsort(descending=True).tolist()
    assert order[:len(kept)] == kept  # the hand-computed sets above assume this ranking
    torch.manual_seed(1)
    sb = _batch([SamplingParams(temperature=1.0, top_k=top_k if top_k else -1, top_p=top_p, min_p=min_p)] * n,
                seeds=list(range(n)) if seeded else None)
    ids, _, _ = sample(LOGITS8.repeat(n, 1), sb)
    counts = torch.bincount(ids, minlength=8)
    others = [t for t in range(8) if t not in kept]
    assert counts[others].sum().item() == 0, "a filtered-out token was drawn"
    q = p[kept] / p[kept].sum()
    assert _chi2(counts[kept], q, n) < CHI2_CRIT.get(len(kept) - 1, 30.0)


def test_top_k_1_and_greedy_rows_are_argmax():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(64, 500, generator=g) * 3
    params = [SamplingParams(temperature=t, top_k=1) for t in (0.5, 1.0, 2.0, 5.0)] * 8 + \
             [SamplingParams(temperature=0.0)] * 16 + [SamplingParams(temperature=1.0)] * 16
    sb = _batch(params, seeds=list(range(64)))
    ids, _, _ = sample(logits, sb)
    assert ids[:48].tolist() == logits[:48].argmax(-1).tolist()
    assert ids[48:].tolist() != logits[48:].argmax(-1).tolist()  # the plain rows really sample


def test_bfloat16_logits_sample_as_their_float32_widening():
    """The head's bf16 logits: an all-greedy batch takes the argmax on them as they are (ties included: widening is
    exact), and every other batch computes on the float32 widening, so both give the float32 logits' results."""
    g = torch.Generator().manual_seed(5)
    logits = (torch.randn(16, 400, generator=g) * 4).to(torch.bfloat16)
    logits[3, 10] = logits[3, 200] = logits[3].max() + 1  # a tie: the lower index wins either way
    wide = logits.float()
    greedy = _batch([SamplingParams(temperature=0.0)] * 16)
    assert sample(logits, greedy)[0].tolist() == sample(wide, greedy)[0].tolist() == wide.argmax(-1).tolist()
    assert sample(logits, greedy)[0][3].item() == 10
    with_logprobs = _batch([SamplingParams(temperature=0.0, logprobs=3)] * 16)
    ids, lp, (top_lp, top_ids) = sample(logits, with_logprobs)
    ids_f, lp_f, (top_lp_f, top_ids_f) = sample(wide, with_logprobs)
    assert lp.dtype == torch.float32 and torch.equal(lp, lp_f) and torch.equal(top_lp, top_lp_f)
    assert torch.equal(ids, ids_f) and torch.equal(top_ids, top_ids_f)
    mixed = _batch([SamplingParams(temperature=0.8, presence_penalty=0.5)] * 8 + [SamplingParams(temperature=0.0)] * 8,
                   seeds=list(range(16)))
    assert torch.equal(sample(logits, mixed)[0], sample(wide, mixed)[0])


def test_same_seed_same_draw_whatever_the_batch():
    g = torch.Generator().manual_seed(2)
    row = torch.randn(1, 300, generator=g)
    p = SamplingParams(temperature=1.3, top_p=0.95)
    alone, _, _ = sample(row, _batch([p], seeds=[77]))
    others = torch.randn(5, 300, generator=g)
    mixed = torch.cat([others[:3], row, others[3:]])
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, top_k=5),
              SamplingParams(temperature=1.0, presence_penalty=1.0), p, SamplingParams(temperature=2.0, min_p=0.1),
              SamplingParams(temperature=1.0)]
    outputs = [[1, 2], [3], [1, 2, 9], [], [4, 4], [1]]  # the target row samples its first token, as alone
    ids, _, _ = sample(mixed, _batch(params, outputs=outputs, seeds=[1, 2, 3, 77, 4, None]))
    assert ids[3].item() == alone[0].item()
    draws = {sample(row, _batch([p], seeds=[s]))[0].item() for s in range(40)}
    assert len(draws) > 5, "different seeds should give different draws on a flat distribution"


# ---------------------------------------------------------------------------------------------------------------
# penalties


def test_penalties_against_hand_computation():
    logits = torch.tensor([[1.0, -2.0, 0.5, 3.0, -0.5, 2.0],
                           [1.0, -2.0, 0.5, 3.0, -0.5, 2.0]])
    prompts = [[0, 3, 5], [0, 3, 5]]
    outputs = [[1, 1, 3], [1, 1, 3]]
    params = [SamplingParams(temperature=0.0, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.5),
              SamplingParams(temperature=0.0)]
    sb = _batch(params, outputs=outputs, prompts=prompts)
    out = apply_penalties(logits.clone(), sb)
    rep = 1.5
    expected = [1.0 / rep, -2.0 * rep, 0.5, 3.0 / rep, -0.5, 2.0 / rep]  # seen: prompt {0, 3, 5} + output {1, 3}
    expected[1] -= 0.3 * 2 + 0.5  # two occurrences in the output
    expected[3] -= 0.3 * 1 + 0.5
    assert torch.allclose(out[0], torch.tensor(expected), atol=1e-6)
    assert torch.equal(out[1], logits[1])  # a row without penalties is untouched


def test_repetition_penalty_matches_hf_processor():
    from transformers import RepetitionPenaltyLogitsProcessor
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 50, generator=g) * 2
    prompts = [[1, 2, 3, 4], [10, 10, 11], [5]]
    outputs = [[3, 7, 7], [], [40, 41, 5]]
    for penalty in (1.3, 0.8):
        sb = _batch([SamplingParams(repetition_penalty=penalty)] * 3, outputs=outputs, prompts=prompts)
        ours = apply_penalties(logits.clone(), sb)
        proc = RepetitionPenaltyLogitsProcessor(penalty)
        for i in range(3):
            ids = torch.tensor([prompts[i] + outputs[i]])
            ref = proc(ids, logits[i:i + 1].clone())[0]
            assert torch.allclose(ours[i], ref, atol=1e-6)


def test_logprobs_are_of_the_raw_distribution():
    """Chosen and top logprobs come from log_softmax of the model's logits, before penalties and temperature."""
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(3, 40, generator=g) * 2
    params = [SamplingParams(temperature=0.0, logprobs=5, presence_penalty=2.0),
              SamplingParams(temperature=0.5, logprobs=3, seed=1), SamplingParams(temperature=2.0, logprobs=0)]
    ids, lp, top = sample(logits, _batch(params, outputs=[[int(logits[0].argmax())], [], []], seeds=[1, 2, 3]))
    ref = torch.log_softmax(logits.double(), -1)
    assert ids[0].item() != logits[0].argmax().item()  # the presence penalty moved the greedy choice
    for i in range(3):
        assert abs(lp[i].item() - ref[i, ids[i]].item()) < 1e-5
    vals, idx = top
    assert vals.shape[1] == 5
    for i in range(3):
        assert torch.allclose(vals[i].double(), ref[i].topk(5).values, atol=1e-5)
        assert idx[i].tolist() == ref[i].topk(5).indices.tolist()


# ---------------------------------------------------------------------------------------------------------------
# end to end on a tiny model


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
