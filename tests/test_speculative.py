"""Speculative decoding against the same run without it: a verify step keeps exactly the tokens plain decoding would
write (greedy, and seeded sampling with every setting), with the same logprobs, ending at the same stop or length,
through retraction, the prefix cache and chunked prefill; the pool and table bookkeeping hold after every step with
rejected drafts given back. Drafts come from an oracle proposer that replays the plain run, corrupted at a set rate,
so that both kept and rejected drafts occur at known rates; NGRAM itself on repeating prompts. The rejection rule's
output distribution is checked against float64 target probabilities (chi-square)."""
from __future__ import annotations

import random
from typing import Dict, List, Sequence, Tuple

import pytest
import torch

from minisrv import SamplingParams
from minisrv.config import EngineConfig
from minisrv.engine.request import Request
from minisrv.engine.sampler import SamplingBatch, sample
from minisrv.engine.scheduler.prefill import MIN_NEW_TOKEN_RATIO
from minisrv.engine.speculative.speculator import Speculator
from minisrv.engine.speculative.verify import accepted_length, sampling_positions

from .helpers import EngineWatch, greedy, make_llm, make_prompts, vocab_of

SPEC = dict(speculative_algorithm="NGRAM", speculative_num_draft_tokens=5)


class ReplayProposer:
    """Proposes what the plain run wrote after the same history, each token replaced by another with probability
    `corrupt` (seeded: the same drafts every run)."""

    def __init__(self, runs: Dict[Tuple[int, ...], List[int]], vocab: int, corrupt: float, seed: int = 0) -> None:
        self.runs, self.vocab, self.corrupt = runs, vocab, corrupt
        self.rng = random.Random(seed)
        self.calls = 0

    def propose(self, key: str, tokens: Sequence[int], num_draft: int) -> List[int]:
        self.calls += 1
        for prompt, out in self.runs.items():
            if tuple(tokens[:len(prompt)]) == prompt:
                done = len(tokens) - len(prompt)
                draft = list(out[done:done + num_draft])
                return [t if self.rng.random() >= self.corrupt else (t + 1 + self.rng.randrange(self.vocab - 1))
                        % self.vocab for t in draft]
        return []

    def release(self, key: str, tokens: Sequence[int]) -> None:
        pass


def run(path, prompts, params, spec=False, corrupt=None, runs=None, optimistic=False, overlap=False, **kw):
    """Outputs and stats of one engine's generate, its pool checked after every step (speculation on with `spec`;
    with `runs`, drafts replayed from them; `optimistic`: admission as after a long run of uneventful decoding, so
    that a small pool runs out and decoding must retract; `overlap`: the next step launched before the previous
    one's tokens are read, as on a GPU)."""
    llm = make_llm(path, **(SPEC if spec else {}), **kw)
    if optimistic:
        llm.engine.scheduler.new_token_ratio = MIN_NEW_TOKEN_RATIO
    if runs is not None:
        llm.engine.speculator.proposer = ReplayProposer(runs, vocab_of(path), corrupt)
    eng = llm.engine
    eng.overlap = overlap
    failed = []  # no step may fail (a failed step is retried alone: the tokens would hide it)
    step_failed = eng._step_failed
    eng._step_failed = lambda reqs, e: failed.append(e) or step_failed(reqs, e)
    watch = EngineWatch(eng)
    outs = llm.generate(prompts, params, use_tqdm=False)
    watch.assert_idle()
    assert not failed, failed
    return outs, eng.stats()


def replayed(path, prompts, params, corrupt, **kw):
    """The plain run, and the speculative run whose drafts replay it (corrupted at `corrupt`)."""
    plain, _ = run(path, prompts, params, **kw)
    runs = {tuple(p): o.token_ids for p, o in zip(prompts, plain)}
    spec, stats = run(path, prompts, params, spec=True, corrupt=corrupt, runs=runs, **kw)
    return plain, spec, stats


def same(a, b) -> None:
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.finish_reason for o in a] == [o.finish_reason for o in b]
    assert [o.text for o in a] == [o.text for o in b]


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_moe", "gemma2"])
@pytest.mark.parametrize("corrupt", [0.0, 0.3])
def test_greedy_tokens_are_the_plain_runs(tiny_model, arch, corrupt):
    path = tiny_model(arch)
    prompts = make_prompts(vocab_of(path), [7, 19, 12], seed=3)
    plain, spec, stats = replayed(path, prompts, greedy(30), corrupt)
    same(plain, spec)
    assert stats["spec_accepted_tokens"] > 0
    if corrupt:
        assert stats["spec_accepted_tokens"] < stats["spec_draft_tokens"]  # some drafts were rejected
    else:  # every draft kept: each step gains its drafts and the target's own token
        assert stats["spec_accepted_tokens"] == stats["spec_draft_tokens"]
        assert stats["spec_verify_steps"] < 30 / 4


@pytest.mark.parametrize("corrupt", [0.5, 1.0])
def test_with_overlap_drafts_wait_for_every_token(tiny_model, corrupt):
    """With the next step launched before the previous one's tokens are read, a request whose drafts keep missing
    backs off and decodes overlapped; when it drafts again its tokens are brought back first (no step fails)."""
    path = tiny_model("llama")
    prompts = make_prompts(vocab_of(path), [12, 7], seed=5)
    plain, spec, stats = replayed(path, prompts, greedy(60), corrupt, overlap=True)
    same(plain, spec)
    assert stats["spec_verify_steps"] > 3


def test_seeded_sampling_and_logprobs_are_the_plain_runs(tiny_model):
    path = tiny_model("llama")
    prompts = make_prompts(vocab_of(path), [9, 14, 6], seed=8)
    params = [SamplingParams(temperature=t, top_p=0.9, top_k=k, min_p=0.01, seed=s, max_tokens=24, ignore_eos=True,
                             logprobs=3, presence_penalty=0.4, frequency_penalty=0.2, repetition_penalty=1.2,
                             logit_bias={5: 1.5, 9: -2.0})
              for t, k, s in ((0.7, 40, 11), (1.0, -1, 12), (0.3, 8, 13))]
    plain, spec, stats = replayed(path, prompts, params, corrupt=0.25)
    same(plain, spec)
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"]
    for a, b in zip(plain, spec):
        for x, y in zip(a.logprobs, b.logprobs):
            assert x.token_id == y.token_id and x.logprob == pytest.approx(y.logprob, abs=1e-4)
            assert x.top.keys() == y.top.keys()
            assert all(x.top[t] == pytest.approx(y.top[t], abs=1e-4) for t in x.top)


def test_a_stop_inside_a_kept_run_ends_the_output_there(tiny_model):
    path = tiny_model("llama")
    prompts = make_prompts(vocab_of(path), [11], seed=21)
    ref, _ = run(path, prompts, greedy(30))
    toks = ref[0].token_ids
    stop_id = next(t for i, t in enumerate(toks) if i >= 6 and t not in toks[:i])  # first seen mid-output
    for params in (greedy(30, stop_token_ids=[stop_id]), greedy(30, stop=[ref[0].text[20:26]])):
        plain, spec, stats = replayed(path, prompts, params, corrupt=0.0)
        same(plain, spec)
        assert plain[0].finish_reason == "stop" and len(plain[0].token_ids) < 30
        assert stats["spec_accepted_tokens"] > 0


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 6, 7, 13])
def test_max_tokens_inside_a_run(tiny_model, max_tokens):
    path = tiny_model("qwen3")
    prompts = make_prompts(vocab_of(path), [10, 5], seed=4)
    plain, spec, _ = replayed(path, prompts, greedy(max_tokens), corrupt=0.0)
    same(plain, spec)
    assert all(len(o.token_ids) == max_tokens and o.finish_reason == "length" for o in spec)


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_retraction_prefix_cache_and_chunked_prefill(tiny_model, arch):
    """A pool too small for every request (retraction), the prefix cache on with shared prompt heads, prompts in
    chunks, prompt logprobs: each as without speculation (gemma2: its windowed layers' own pages too)."""
    path = tiny_model(arch)
    head = make_prompts(vocab_of(path), [40], seed=2)[0]
    prompts = [head + p for p in make_prompts(vocab_of(path), [30, 45, 20, 38], seed=9)]
    kw = dict(disable_radix_cache=False, max_total_tokens=250, chunked_prefill_size=32, page_size=4, optimistic=True)
    params = greedy(60, prompt_logprobs=1)
    plain, spec, stats = replayed(path, prompts, params, corrupt=0.2, **kw)
    same(plain, spec)
    for a, b in zip(plain, spec):
        assert [x and x.token_id for x in a.prompt_logprobs] == [x and x.token_id for x in b.prompt_logprobs]
    assert stats["num_retractions"] > 0 and stats["spec_accepted_tokens"] > 0


def test_ngram_drafts_on_repeating_prompts(tiny_model):
    """NGRAM itself: prompts that repeat a stretch, decoded greedily, plus a batch larger than the speculation
    limit (decoded plainly while it is): the plain run's tokens."""
    path = tiny_model("llama")
    rows = make_prompts(vocab_of(path), [16, 24, 9, 30, 12, 20], seed=31)
    prompts = [r * 3 for r in rows]
    params = [greedy(n) for n in (10, 20, 30, 40, 50, 60)]  # the batch shrinks below the limit as they end
    plain, _ = run(path, prompts, params)
    spec, stats = run(path, prompts, params, spec=True, speculative_disable_by_batch_size=3)
    same(plain, spec)
    assert stats["spec_verify_steps"] > 0 and stats["spec_draft_tokens"] > 0


class _Req:
    def __init__(self, rid, needs=False, out=0, max_new=100):
        self.rid, self.needs_accepted_tokens = rid, needs
        self.all_ids, self.num_output_tokens, self.max_new_tokens = [1, 2, 3], out, max_new
        self.num_pending = 0


class _WrongProposer:
    def __init__(self):
        self.calls = 0

    def propose(self, key, tokens, num_draft):
        self.calls += 1
        return [7] * num_draft

    def release(self, key, tokens):
        pass


def test_speculator_backs_off_drafts_that_miss_and_skips_what_it_must():
    p = _WrongProposer()
    s = Speculator(p, num_draft_tokens=4, disable_by_batch_size=2)
    reqs = [_Req("a"), _Req("g", needs=True), _Req("end", out=99)]
    assert s.drafts(reqs[:1] * 3) is None  # above the batch-size limit: no drafts at all
    tried = 0
    for _ in range(40):
        d = s.drafts(reqs[:2])
        if d is not None:
            assert d[1] == []  # a request with a grammar or thinking budget never drafts
            tried += 1
            s.verified(reqs[0], len(d[0]), 0)  # every draft missed
    assert tried <= 7  # waits of 1, 2, 4, 8, 16, 32 steps: a few tries in 40 steps
    assert s.drafts([reqs[2]]) is None  # the last allowed token: nothing to draft
    s.verified(reqs[1], 0, 0)  # verified beside the drafters with no draft of its own (never looked up)
    s.verified(reqs[0], 3, 2)  # a kept draft ends the back-off
    assert s.drafts([reqs[0]]) == [[7, 7, 7]]


def test_adaptive_draft_length_follows_what_was_kept():
    p = _WrongProposer()
    s = Speculator(p, num_draft_tokens=5, disable_by_batch_size=4, adaptive_length=True)
    r = _Req("a")
    assert s.drafts([r]) == [[7] * 4]
    s.verified(r, 4, 1)  # one kept: the next draft is two long
    assert s.drafts([r]) == [[7] * 2]
    s.verified(r, 2, 2)  # all kept: one longer, up to the most
    assert s.drafts([r]) == [[7] * 3]
    s.verified(r, 3, 3)
    s.verified(r, 4, 4)
    assert s.drafts([r]) == [[7] * 4]
    fixed = Speculator(_WrongProposer(), num_draft_tokens=5, disable_by_batch_size=4)
    assert fixed.drafts([r]) == [[7] * 4]
    fixed.verified(r, 4, 1)
    assert fixed.drafts([r]) == [[7] * 4]


def test_rejected_settings_are_errors_at_start():
    with pytest.raises(ValueError, match="speculative_algorithm"):
        EngineConfig(speculative_algorithm="MEDUSA")
    with pytest.raises(ValueError, match="num_draft_tokens"):
        EngineConfig(speculative_algorithm="ngram", speculative_num_draft_tokens=1)
    assert EngineConfig(speculative_algorithm="ngram").speculative_algorithm == "NGRAM"


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token of probability 0 was drawn"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


@pytest.mark.parametrize("temperature,top_k", [(1.0, -1), (0.7, 3)])
def test_rejection_rule_keeps_the_targets_distribution(temperature, top_k):
    """Many independent verifications of one draft [d0, d1] over fixed logits at three positions: the first token
    out is distributed as the target's p0, the second (given d0 kept) as p1, the third (given both kept) as p2."""
    torch.manual_seed(0)
    vocab, n = 6, 20000
    logits = torch.tensor([[1.0, 0.2, 2.0, -1.0, 0.5, 0.0], [0.3, 1.5, -0.5, 1.0, 0.0, 0.8],
                           [0.0, 0.0, 1.0, 2.0, -2.0, 0.4]], dtype=torch.float64)
    draft = [2, 1]
    params = SamplingParams(temperature=temperature, top_k=top_k, max_tokens=10)
    reqs = [Request([1, 2, 3], params, 10, eos_ids=(0,)) for _ in range(n)]
    rows = sampling_positions(reqs, [draft] * n)
    ids, _, _ = sample(logits.float().repeat(n, 1), SamplingBatch.build(rows, torch.device("cpu")))
    ids = ids.view(n, 3).tolist()
    out = [[] for _ in range(3)]
    for s in ids:
        kept = accepted_length(s, draft)
        for j in range(kept + 1):
            out[j].append(s[j])
    scaled = logits / temperature
    if top_k > 0:
        scaled = scaled.masked_fill(scaled < scaled.topk(top_k, dim=-1).values[:, -1:], float("-inf"))
    target = torch.softmax(scaled, dim=-1)
    assert len(out[1]) == pytest.approx(n * target[0, 2].item(), rel=0.05)  # d0 kept with probability p0(d0)
    for j in range(3):
        counts = torch.bincount(torch.tensor(out[j]), minlength=vocab).double()
        assert _chi_square(counts, target[j]) < 20.5  # 5 degrees of freedom, p = 0.001
