"""Sampling: the filters (top-k, top-p, min-p) against hand-computed sets, the Gumbel-max draw against
softmax(logits / T) by a chi-square test, penalties against hand computation and HF's logits processor, seeds and
logprobs, on the sampler's own batches. End to end on a tiny model: test_sampler_end_to_end.py."""
from __future__ import annotations

import dataclasses
import random
from typing import List, Sequence, Set

import pytest
import torch

from minisrv import SamplingParams
from minisrv.engine.request import Request
from minisrv.engine.sampler import SamplingBatch, apply_penalties, filter_mask, hashed_uniform, sample

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
