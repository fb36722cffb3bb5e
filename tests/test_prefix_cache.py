"""The radix prefix cache in the engine: requests that share a prefix reuse its KV and still produce HF's tokens and
logits; pages are shared, evicted and freed correctly under chunking, retraction and overlap; the same run with the
cache off is the reference for what is reused."""
from __future__ import annotations

import random

import pytest

from .helpers import (EngineWatch, assert_greedy_matches, assert_pool_free, greedy, hf_greedy, make_llm,
                      tree_pages, vocab_of)

MAX_TOKENS = 6

MODES = {
    "page1": dict(page_size=1),
    "page4": dict(page_size=4),
    "page16": dict(page_size=16),
    "chunked": dict(page_size=3, chunked_prefill_size=8, max_prefill_tokens=16),
    # a pool too small for the batch: the tree must give pages back, and decode must retract
    "tight": dict(page_size=2, max_total_tokens=96, chunked_prefill_size=8, max_prefill_tokens=16),
    "overlap_tight": dict(page_size=2, max_total_tokens=96, chunked_prefill_size=8, max_prefill_tokens=16,
                          overlap=True),
}


def shared_prompts(vocab: int, seed: int = 7):
    """Two system prompts (30 and 21 tokens), each followed by several short user parts."""
    rng = random.Random(seed)
    systems = [[rng.randrange(3, vocab) for _ in range(n)] for n in (30, 21)]
    return [systems[i % 2] + [rng.randrange(3, vocab) for _ in range(rng.randrange(2, 9))] for i in range(10)]


@pytest.mark.parametrize("mode", list(MODES))
def test_shared_prefixes_match_hf_and_reuse_the_cache(tiny_model, mode):
    path = tiny_model("qwen3")
    kw = dict(MODES[mode])
    overlap = kw.pop("overlap", False)
    llm = make_llm(path, disable_radix_cache=False, **kw)
    eng = llm.engine
    eng.overlap = overlap
    ps = eng.parts.pool.page_size
    watch = EngineWatch(eng)
    prompts = shared_prompts(vocab_of(path))
    outs = llm.generate(prompts, greedy(MAX_TOKENS), use_tqdm=False)  # later prompts reuse the earlier ones'
    again = llm.generate(prompts, greedy(MAX_TOKENS), use_tqdm=False)  # now every prompt is in the tree
    for i, p in enumerate(prompts):
        ref, scores = hf_greedy(path, p, MAX_TOKENS)
        assert_greedy_matches(outs[i].token_ids, ref, scores, f"{mode} prompt {i}")
        assert again[i].token_ids == outs[i].token_ids
    assert watch.check_logits(path) >= 2 * len(prompts) * MAX_TOKENS
    watch.assert_idle()
    assert_pool_free(eng)
    assert eng.num_cached_prompt_tokens > 0
    if "tight" not in mode:  # with room, the second run finds each prompt's full pages but its last token
        second = sorted(watch.reqs.values(), key=lambda r: r.arrival)[-len(prompts):]
        for p, r in zip(prompts, second):
            assert r.num_cached_tokens == (len(p) - 1) // ps * ps, (len(p), r.num_cached_tokens)


def test_cache_off_reuses_nothing(tiny_model):
    path = tiny_model("qwen3")
    llm = make_llm(path, page_size=2)
    prompts = shared_prompts(vocab_of(path))
    llm.generate(prompts, greedy(MAX_TOKENS), use_tqdm=False)
    llm.generate(prompts, greedy(MAX_TOKENS), use_tqdm=False)
    assert llm.engine.num_cached_prompt_tokens == 0 and llm.engine.cache is None


def test_multi_turn_reuses_the_whole_conversation(tiny_model):
    """Turn 2 resends turn 1's prompt and answer: everything but the new tail comes from the cache."""
    path = tiny_model("llama")
    llm = make_llm(path, disable_radix_cache=False, page_size=4)
    eng = llm.engine
    vocab = vocab_of(path)
    rng = random.Random(3)
    turn1 = [rng.randrange(3, vocab) for _ in range(23)]
    out1 = llm.generate(turn1, greedy(9), use_tqdm=False)[0]
    turn2 = turn1 + out1.token_ids + [rng.randrange(3, vocab) for _ in range(5)]
    r = eng.add_request(turn2, greedy(5))
    while eng.has_work():
        eng.step()
    # turn 1's prompt and all but its last output token have KV (the last was sampled, never fed back)
    computed = len(turn1) + len(out1.token_ids) - 1
    assert r.num_cached_tokens == computed // 4 * 4
    ref, scores = hf_greedy(path, turn2, 5)
    assert_greedy_matches(r.output_ids, ref, scores, "turn 2")


def test_eviction_under_pressure_loses_nothing(tiny_model):
    """Many distinct prompts through a small pool: the tree fills, is evicted LRU, and every request completes."""
    path = tiny_model("qwen2")
    llm = make_llm(path, disable_radix_cache=False, page_size=2, max_total_tokens=80)
    eng = llm.engine
    watch = EngineWatch(eng)
    vocab = vocab_of(path)
    rng = random.Random(11)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randrange(10, 30))] for _ in range(12)]
    outs = llm.generate(prompts, greedy(MAX_TOKENS), use_tqdm=False)
    assert eng.cache.num_pages <= eng.parts.allocator.num_pages
    for p, o in zip(prompts, outs):
        ref, scores = hf_greedy(path, p, MAX_TOKENS)
        assert_greedy_matches(o.token_ids, ref, scores, "under eviction")
    watch.assert_idle()
    assert tree_pages(eng), "the tree keeps what it could"


def test_flush_cache_only_when_idle(tiny_model):
    path = tiny_model("qwen3")
    llm = make_llm(path, disable_radix_cache=False, page_size=2)
    eng = llm.engine
    prompt = shared_prompts(vocab_of(path))[0]
    llm.generate(prompt, greedy(3), use_tqdm=False)
    assert eng.cache.num_pages > 0
    eng.add_request(prompt, greedy(3))
    assert eng.flush_cache() is False and eng.cache.num_pages > 0
    while eng.has_work():
        eng.step()
    assert eng.flush_cache() is True
    assert eng.cache.num_pages == 0 and eng.parts.allocator.num_free == eng.parts.allocator.num_pages
    assert eng.stats()["cache_tokens"] == 0


@pytest.mark.parametrize("page_size", [1, 16])
def test_prefix_lengths_at_page_edges_give_the_same_tokens_as_cache_off(tiny_model, page_size):
    """Shared prefixes of exactly a page, one token short of a page, one over, and a whole earlier prompt, with
    chunked prefill and a pool small enough for eviction and retraction: the same greedy tokens with and without
    the cache, token for token."""
    path = tiny_model("llama")
    vocab = vocab_of(path)
    rng = random.Random(page_size)
    base = [rng.randrange(3, vocab) for _ in range(3 * 16 + 5)]
    prompts = [base[:16] + [7, 8, 9], base[:15] + [7, 8], base[:17] + [5], base[:40], base[:40] + [11, 12],
               base, base[:33] + [rng.randrange(3, vocab) for _ in range(9)]]
    kw = dict(page_size=page_size, chunked_prefill_size=16, max_prefill_tokens=32, max_total_tokens=160)
    outs = {}
    for cache in (True, False):
        llm = make_llm(path, disable_radix_cache=not cache, **kw)
        llm.engine.scheduler.new_token_ratio = 0.1  # admit optimistically, so decode has to retract
        watch = EngineWatch(llm.engine)
        first = llm.generate(prompts[:3], greedy(MAX_TOKENS), use_tqdm=False)
        rest = llm.generate(prompts[3:], greedy(MAX_TOKENS), use_tqdm=False)
        outs[cache] = [o.token_ids for o in first + rest]
        watch.assert_idle()
        if cache:
            assert llm.engine.num_cached_prompt_tokens > 0
            assert llm.engine.flush_cache() \
                and llm.engine.parts.allocator.num_free == llm.engine.parts.allocator.num_pages
    assert outs[True] == outs[False]


def test_aborting_a_sharing_request_frees_only_its_own_share(tiny_model):
    path = tiny_model("qwen3")
    llm = make_llm(path, disable_radix_cache=False, page_size=2)
    eng = llm.engine
    prompt = shared_prompts(vocab_of(path))[0]
    llm.generate(prompt, greedy(2), use_tqdm=False)  # the prefix is in the tree
    a = eng.add_request(prompt + [5, 6], greedy(8))
    b = eng.add_request(prompt + [7, 8], greedy(8))
    eng.step()
    eng.step()
    shared = set(a.pages) & set(b.pages)
    assert shared and a.num_cached_tokens > 0 and b.num_cached_tokens > 0
    own = set(a.pages) - shared
    refs = {p: eng.parts.allocator.refcount(p) for p in shared}
    eng.abort(a.rid)
    assert all(eng.parts.allocator.refcount(p) == refs[p] - 1 for p in shared)  # b and the tree still hold them
    assert all(eng.parts.allocator.refcount(p) >= 1 for p in shared) and set(b.pages) >= shared
    assert all(eng.parts.allocator.refcount(p) <= 1 for p in own)  # a's own pages: freed, or kept by the tree alone
    while eng.has_work():
        eng.step()
    ref, scores = hf_greedy(path, prompt + [7, 8], 8)
    assert_greedy_matches(b.output_ids, ref, scores, "beside an aborted sharer")
    assert_pool_free(eng)


def test_requests_sharing_an_uncached_prefix_are_not_computed_twice_in_one_batch(tiny_model):
    """Queued together, requests that start alike are split: the first computes the prefix, the others wait one step
    and take it from the cache; every one matches HF."""
    path = tiny_model("qwen3")
    llm = make_llm(path, disable_radix_cache=False, page_size=4)
    eng = llm.engine
    vocab = vocab_of(path)
    rng = random.Random(9)
    system = [rng.randrange(3, vocab) for _ in range(48)]
    prompts = [system + [rng.randrange(3, vocab) for _ in range(5)] for _ in range(4)]
    watch = EngineWatch(eng)
    outs = llm.generate(prompts, greedy(MAX_TOKENS), use_tqdm=False)
    reqs = sorted(watch.reqs.values(), key=lambda r: r.arrival)
    assert reqs[0].num_cached_tokens == 0 and all(r.num_cached_tokens == 48 for r in reqs[1:])
    for p, o in zip(prompts, outs):
        ref, scores = hf_greedy(path, p, MAX_TOKENS)
        assert_greedy_matches(o.token_ids, ref, scores, "deferred within a batch")
    watch.assert_idle()
