"""Windowed layers that keep only their window: their K/V in pages of their own beside the full layers' pages.

The rule of which windowed pages a query reads and how much of a cached prefix is usable, the prefix tree's windowed
pages (kept, split, refilled, given back least recently used first), the pool's sizing and its memory per token of
context for a Gemma-3-12B-like shape, and tiny windowed models (tests/helpers/tiny_models.py: windows of 8 tokens)
served over a small windowed pool with the pool's bookkeeping checked every step (EngineWatch): greedy tokens and
logits against HF transformers under retraction and with prefix-cache hits that keep their window or are shortened.
"""
from __future__ import annotations

import torch

from minisrv.engine.scheduler import MIN_NEW_TOKEN_RATIO
from minisrv.kvcache import KVPool, PageAllocator, WindowRule
from minisrv.kvcache.radix import RadixCache
from minisrv.kvcache.window import split_pool_pages, windowed_layers

from .helpers import (EngineWatch, tree_pages, assert_greedy_matches, assert_pool_free, greedy, hf_greedy, make_llm,
                      make_prompts, vocab_of)

MAX_TOKENS = 10


def test_the_window_rule():
    rule = WindowRule(window=8, page_size=2)
    # a query at 9 reads keys 2..9: pages from 1; at 7 (keys 0..7) from page 0
    assert [rule.first_page(p) for p in (0, 7, 8, 9, 10, 20)] == [0, 0, 0, 1, 1, 6]
    # a prefix of 6 pages (12 tokens) is continued from at 12: keys 5..11, pages 2..5
    assert rule.usable_pages([1, 2, 3, 4, 5, 6]) == 6
    assert rule.usable_pages([None, None, 3, 4, 5, 6]) == 6
    assert rule.usable_pages([1, 2, 3, None, 5, 6]) == 3  # at 6 tokens: keys 0..5, pages 0..2
    assert rule.usable_pages([None, 2, 3, None, 5, 6]) == 0
    assert windowed_layers([8, None, 8, 300], 256, 2) == (frozenset({0, 2}), WindowRule(8, 2))
    assert windowed_layers([None, 512], 256, 1) == (frozenset(), None)


def test_tree_keeps_splits_refills_and_gives_back_windowed_pages():
    full, win = PageAllocator(16), PageAllocator(16)
    tree = RadixCache(full, 1, win)
    pages, wpages = full.alloc(6), win.alloc(6)
    tree.insert(list(range(6)), pages, [None, None] + wpages[2:])
    m = tree.match_prefix(list(range(4)) + [9])  # splits the node after 4 tokens
    assert m.pages == pages[:4] and m.window_pages == [None, None] + wpages[2:4]
    assert [win.refcount(p) for p in wpages] == [1, 1, 2, 2, 2, 2]
    tree.insert(list(range(6)), pages, wpages)  # a later holder of the same tokens fills the gaps
    assert tree.match_prefix(list(range(6))).window_pages == wpages and win.refcount(wpages[0]) == 2
    win.free(wpages)  # the caller's own references: only the tree holds them now
    tree.match_prefix([0, 1, 2, 3])  # the upper node is the more recently used
    tree.evict_windows(win.num_free + 3)  # the lower node's two pages, then the upper node's first
    assert tree.match_prefix(list(range(6))).window_pages == [None] + wpages[1:4] + [None, None]
    full.free(pages)
    assert tree.evict(6) == 6 and full.num_free == 16 and win.num_free == 16


def test_pool_sizing_and_memory_per_token_of_a_gemma3_12b_shape():
    # Gemma-3-12B: 48 layers, every sixth global, a 1024-token window, 8 KV heads of 256, bf16
    layers, window = 48, 1024
    windows = [None if (i + 1) % 6 == 0 else window for i in range(layers)]
    ids, rule = windowed_layers(windows, 32768, 16)
    assert len(ids) == 40 and rule == WindowRule(1024, 16)
    per_layer = KVPool.bytes_per_token(1, 8, 256, torch.bfloat16)
    context = 32768
    pages = context // 16
    held = pages - rule.first_page(context)  # windowed pages a request at 32k tokens still holds
    split = (8 * context + 40 * held * 16) * per_layer / context
    all_global = 48 * per_layer
    assert split <= all_global / 3
    assert round(split / all_global, 3) == 0.193  # the figure: 0.193 of every layer global (74 KiB vs 384 KiB)
    # the memory of 100k tokens in every layer, 8 requests running: the windowed pages hold their windows and a
    # step's prefill, the full layers get 4.7x the tokens
    least, most = 8192 + 2 * (window + 16), 8 * (window + 16) + 16384
    full, win = split_pool_pages(100_000, layers, 40, 0.8, 16, least, most)
    assert win * 16 == most and full * 16 > 4.7 * 100_000
    assert (8 * full + 40 * win) * 16 <= 100_000 * 48
    # with many requests running, windowed pages are 0.8 of the full ones (SGLang's default ratio): 1.2x the tokens
    full, win = split_pool_pages(100_000, layers, 40, 0.8, 16, least, 256 * (window + 16) + 16384)
    assert win == int(full * 0.8) and full * 16 == 120_000
    # a tiny pool still holds one request's widest step in its windowed pages
    full, win = split_pool_pages(64, 3, 2, 0.1, 2, 25, 2570)
    assert win == 14 and (full + 2 * win) * 2 <= 64 * 3 + 2 * 2 * 14


def test_start_up_says_the_pools_memory_per_token(tiny_model, caplog):
    """The start-up log gives the pool's bytes per token of context and its share of every layer global (what the
    Gemma 3 benchmark reports), as the pool holds them."""
    with caplog.at_level("INFO", logger="minisrv"):
        llm = make_llm(tiny_model("gemma3"), page_size=2, max_total_tokens=512, log_level="info")
    pool = llm.engine.parts.pool
    line = next(r.getMessage() for r in caplog.records if "keep only their window" in r.getMessage())
    per_token = pool.nbytes / pool.num_slots
    all_global = KVPool.bytes_per_token(pool.num_layers, pool.num_kv_heads, pool.head_dim, pool.kv_dtype)
    assert per_token < all_global and f"{per_token:.0f} bytes per token of context" in line
    assert f"{per_token / all_global:.3f} of every layer global" in line


def test_models_without_windows_keep_one_pool(tiny_model):
    llm = make_llm(tiny_model("llama"))
    parts = llm.engine.parts
    assert parts.window_allocator is None and parts.table.window_table is None and not parts.pool.window_layers
    assert llm.engine.scheduler.cache.windows is None


def _serve_and_check(llm, path, prompts, label):
    watch = EngineWatch(llm.engine)
    outs = llm.generate(prompts, greedy(MAX_TOKENS), use_tqdm=False)
    for i, (p, o) in enumerate(zip(prompts, outs)):
        ref, scores = hf_greedy(path, p, MAX_TOKENS)
        assert_greedy_matches(o.token_ids, ref, scores, f"{label} prompt {i} ({len(p)} tokens)")
    assert watch.check_logits(path) >= len(prompts) * MAX_TOKENS
    watch.assert_idle()
    return outs


def test_small_windowed_pool_matches_hf(tiny_model):
    """Six prompts over 28 windowed tokens: chunks of 5 cross the window's edge, each request holds only its
    window, and the prefix tree gives its windowed pages back to make room for them."""
    path = tiny_model("gemma2")
    llm = make_llm(path, page_size=2, chunked_prefill_size=5, max_prefill_tokens=10, max_total_tokens=512,
                   swa_full_tokens_ratio=0.01, disable_radix_cache=False)
    parts = llm.engine.parts
    assert parts.pool.window_layers == frozenset({0, 2}) and parts.window_allocator.num_pages == 14
    assert parts.pool.k[0].shape[0] == 14 and parts.pool.k[1].shape[0] == parts.allocator.num_pages
    prompts = make_prompts(vocab_of(path), [30, 21, 9, 26, 14, 33], seed=11)
    _serve_and_check(llm, path, prompts, "small windowed pool")
    # (the tree cached every prompt's full pages, 60 of them, but could keep only 14 windowed pages)
    assert len(tree_pages(llm.engine)) > 60 and len(tree_pages(llm.engine, window=True)) <= 14


def test_retraction_under_a_small_pool_matches_hf(tiny_model):
    path = tiny_model("gemma2")
    llm = make_llm(path, max_total_tokens=56, page_size=2, chunked_prefill_size=8, max_prefill_tokens=16,
                   swa_full_tokens_ratio=1.0)
    assert llm.engine.parts.pool.window_layers == frozenset({0, 2})
    llm.engine.scheduler.new_token_ratio = MIN_NEW_TOKEN_RATIO  # admit optimistically: decode must retract
    prompts = make_prompts(vocab_of(path), [5, 40, 3, 23, 12, 31], seed=11)
    _serve_and_check(llm, path, prompts, "retraction")
    assert llm.engine.scheduler.num_retractions > 0


def test_prefix_hits_keep_their_window_or_are_shortened(tiny_model):
    path = tiny_model("gemma3")
    llm = make_llm(path, page_size=2, disable_radix_cache=False)
    engine = llm.engine
    base = make_prompts(vocab_of(path), [30], seed=12)[0]
    _serve_and_check(llm, path, [base], "first")
    # the whole prompt is cached, windows included: a longer prompt continues from all of it but its last token
    first = engine.num_cached_prompt_tokens
    _serve_and_check(llm, path, [base + [5, 6, 7]], "kept")
    assert engine.num_cached_prompt_tokens - first == 30
    # the tree gives back the windowed pages of positions 20..: a hit continues from at most 20 tokens
    node, pos = engine.cache.root, 0
    while pos < 30:
        node = node.children[tuple(base[pos:pos + 2])]
        for i, p in enumerate(node.window_pages):
            if p is not None and pos + 2 * i >= 20:
                engine.parts.window_allocator.free([p])
                node.window_pages[i] = None
        pos += len(node.key)
    before = engine.num_cached_prompt_tokens
    _serve_and_check(llm, path, [base + [9, 9]], "shortened")
    assert engine.num_cached_prompt_tokens - before == 20
    # with every windowed page given back, nothing is reused
    engine.cache.evict_windows(engine.parts.window_allocator.num_pages)
    before = engine.num_cached_prompt_tokens
    _serve_and_check(llm, path, [base + [3]], "no window")
    assert engine.num_cached_prompt_tokens == before
    assert_pool_free(engine)
