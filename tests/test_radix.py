"""The radix prefix cache against independent references: a list of inserted sequences (longest common prefix,
floored to pages), and a page-level model of the cache (a dict from each cached whole-page prefix to its page and
last-access time, with LRU eviction done one page at a time by brute force). Hand-built scenarios:
test_radix_scenarios.py."""
from __future__ import annotations

import random
from collections import Counter
from typing import Dict, List, Tuple

import pytest

from minisrv.kvcache.allocator import PageAllocator
from minisrv.kvcache.radix import RadixCache, RadixNode

from .helpers.radix_checks import Tokens, tree_map, walk_evictable


# ---------------------------------------------------------------------------------------------------------------
# helpers


def make_seq(rng: random.Random, pool: List[Tokens], vocab: int, max_len: int) -> Tokens:
    """Often an earlier sequence cut anywhere (also mid-page) plus a random tail, so prefixes collide."""
    if pool and rng.random() < 0.75:
        base = rng.choice(pool)
        base = base[: rng.randint(0, len(base))]
    else:
        base = ()
    tail = tuple(rng.randrange(vocab) for _ in range(rng.randint(0, max_len)))
    return (base + tail)[:max_len]


# ---------------------------------------------------------------------------------------------------------------
# match / insert against the list-of-sequences reference


@pytest.mark.parametrize("page_size,vocab,max_len", [(1, 3, 12), (2, 3, 16), (16, 2, 80)])
def test_match_insert_vs_bruteforce(page_size: int, vocab: int, max_len: int) -> None:
    rng = random.Random(1234 + page_size)
    alloc = PageAllocator(20000)
    cache = RadixCache(alloc, page_size)
    inserted: List[Tuple[Tokens, List[int]]] = []  # in insertion order

    def expected(q: Tokens) -> Tuple[int, List[int]]:
        best = 0
        for s, _ in inserted:
            n = 0
            while n < min(len(s), len(q)) and s[n] == q[n]:
                n += 1
            best = max(best, n - n % page_size)
        pages = []
        for i in range(best // page_size):  # the first inserter that covered page i of this prefix owns it
            end = (i + 1) * page_size
            pages.append(next(p[i] for s, p in inserted if len(s) >= end and s[:end] == q[:end]))
        return best, pages

    for _ in range(400):
        q = make_seq(rng, [s for s, _ in inserted], vocab, max_len)
        if rng.random() < 0.5:
            want_len, want_pages = expected(q)
            m = cache.match_prefix(q)
            assert (m.num_tokens, m.pages) == (want_len, want_pages)
        else:
            q = q[: len(q) - len(q) % page_size]
            want_len, _ = expected(q)
            pages = alloc.alloc(len(q) // page_size)
            cached, node = cache.insert(q, pages)
            assert cached == want_len
            alloc.free(pages)
            inserted.append((q, pages))
            # the returned node ends exactly at q: locking it protects exactly len(q) // page_size pages
            before = cache.evictable_pages
            cache.lock(node)
            assert before - cache.evictable_pages == len(q) // page_size
            cache.unlock(node)
    assert len(inserted) > 100 and cache.num_pages > 50
    # every cached page is held by the tree alone
    held = tree_map(cache)
    assert all(alloc.refcount(p) == 1 for p in held.values())
    assert alloc.num_free + len(held) == alloc.num_pages


# ---------------------------------------------------------------------------------------------------------------
# full fuzz: requests, locks, eviction, refcounts, against a page-level model


class Model:
    """Cached whole-page prefixes -> [page, last access]; locks are the locked prefixes."""

    def __init__(self, page_size: int) -> None:
        self.ps = page_size
        self.pages: Dict[Tokens, List[int]] = {}
        self.locks: List[Tokens] = []
        self.clock = 0

    def match(self, q: Tokens) -> Tuple[int, List[int]]:
        self.clock += 1
        n, out = 0, []
        while n + self.ps <= len(q) and q[: n + self.ps] in self.pages:
            n += self.ps
            entry = self.pages[q[:n]]
            entry[1] = self.clock
            out.append(entry[0])
        return n, out

    def insert(self, q: Tokens, pages: List[int]) -> Tuple[int, List[int]]:
        """Returns (already cached tokens, pages adopted)."""
        self.clock += 1
        cached, adopted = 0, []
        for i in range(len(q) // self.ps):
            key = q[: (i + 1) * self.ps]
            if key in self.pages:
                cached = len(key)
                self.pages[key][1] = self.clock
            else:
                self.pages[key] = [pages[i], self.clock]
                adopted.append(pages[i])
        return cached, adopted

    def locked(self, key: Tokens) -> bool:
        return any(lk[: len(key)] == key for lk in self.locks)

    def evictable(self) -> int:
        return sum(1 for k in self.pages if not self.locked(k))

    def evict(self, n: int) -> List[int]:
        freed = []
        for _ in range(n):
            parents = {k[: -self.ps] for k in self.pages}
            leaves = [k for k in self.pages if k not in parents and not self.locked(k)]
            if not leaves:
                break
            k = min(leaves, key=lambda k: self.pages[k][1])
            freed.append(self.pages.pop(k)[0])
        return freed


@pytest.mark.parametrize("page_size,vocab,max_len,pool_pages", [(1, 3, 10, 30), (2, 3, 16, 24), (16, 2, 64, 12)])
def test_fuzz_refcounts_locks_eviction(page_size: int, vocab: int, max_len: int, pool_pages: int) -> None:
    rng = random.Random(99 + page_size)
    alloc = PageAllocator(pool_pages)
    cache = RadixCache(alloc, page_size)
    model = Model(page_size)
    mine: Counter = Counter()  # references the test (its "requests") holds
    running: List[Tuple[Tokens, List[int], RadixNode, Tokens]] = []  # seq, its pages, locked node, locked prefix
    history: List[Tokens] = []

    def release(pages: List[int]) -> None:
        alloc.free(pages)
        mine.subtract(pages)

    def check() -> None:
        assert tree_map(cache) == {k: v[0] for k, v in model.pages.items()}
        held = {v[0] for v in model.pages.values()}
        for p in range(alloc.num_pages):
            assert alloc.refcount(p) == (p in held) + mine[p], p
        assert alloc.num_free == sum(1 for p in range(alloc.num_pages) if (p in held) + mine[p] == 0)
        assert cache.num_pages == len(held) and cache.num_tokens == len(held) * page_size
        assert cache.evictable_pages == walk_evictable(cache) == model.evictable()

    evicted_total = 0
    for step in range(1500):
        op = rng.random()
        if op < 0.4 and len(running) < 4:  # a request arrives: reuse the cached prefix, allocate the rest
            seq = make_seq(rng, history, vocab, max_len)
            history.append(seq)
            m = cache.match_prefix(seq)
            want_len, want_pages = model.match(seq)
            assert (m.num_tokens, m.pages) == (want_len, want_pages)
            cache.lock(m.node)
            model.locks.append(seq[: m.num_tokens])
            alloc.incref(m.pages)
            mine.update(m.pages)
            need = -(-(len(seq) - m.num_tokens) // page_size)
            if need > alloc.num_free:
                want_freed = model.evict(need - alloc.num_free)
                got = cache.evict(need - alloc.num_free)
                assert got == len(want_freed)
                evicted_total += got
            check()
            if need > alloc.num_free:  # still no room: the request is turned away
                release(m.pages)
                cache.unlock(m.node)
                model.locks.remove(seq[: m.num_tokens])
            else:
                new = alloc.alloc(need)
                mine.update(new)
                running.append((seq, m.pages + new, m.node, seq[: m.num_tokens]))
        elif op < 0.75 and running:  # a request finishes (or checkpoints): its full pages go into the tree
            seq, pages, node, locked_prefix = running.pop(rng.randrange(len(running)))
            full = seq[: len(seq) - len(seq) % page_size]
            cached, new_node = cache.insert(full, pages[: len(full) // page_size])
            assert cached == model.insert(full, pages)[0]
            cache.unlock(node)
            model.locks.remove(locked_prefix)
            if rng.random() < 0.3:  # checkpoint: keep running, locked at the newly cached end
                cache.lock(new_node)
                model.locks.append(full)
                running.append((seq, pages, new_node, full))
            else:
                release(pages)
        elif op < 0.85:  # a bare lookup
            q = make_seq(rng, history, vocab, max_len)
            m = cache.match_prefix(q)
            assert (m.num_tokens, m.pages) == model.match(q)
        else:  # memory pressure
            n = rng.randint(1, 4)
            want_freed = model.evict(n)
            assert cache.evict(n) == len(want_freed)
            evicted_total += len(want_freed)
        check()

    assert evicted_total > 50
    for seq, pages, node, locked_prefix in running:
        cache.unlock(node)
        release(pages)
    model.locks.clear()
    check()
    assert cache.evict(10**9) == len(model.evict(10**9))
    check()
    assert cache.num_pages == 0 and cache.evictable_pages == 0
    assert cache.reset()
    assert alloc.num_free == alloc.num_pages and sum(mine.values()) == 0
