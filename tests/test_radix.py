"""The radix prefix cache against independent references: a list of inserted sequences (longest common prefix,
floored to pages), and a page-level model of the cache (a dict from each cached whole-page prefix to its page and
last-access time, with LRU eviction done one page at a time by brute force), plus hand-built scenarios whose
expected outcomes are worked out by hand."""
from __future__ import annotations

import random
from collections import Counter
from typing import Dict, List, Sequence, Tuple

import pytest

from minisrv.kvcache.allocator import PageAllocator
from minisrv.kvcache.radix import RadixCache, RadixNode

Tokens = Tuple[int, ...]


# ---------------------------------------------------------------------------------------------------------------
# helpers


def tree_map(cache: RadixCache) -> Dict[Tokens, int]:
    """Walk the tree: every whole-page prefix it spells -> its page. Checks the structural invariants on the way."""
    ps = cache.page_size
    out: Dict[Tokens, int] = {}
    stack: List[Tuple[RadixNode, Tokens]] = [(cache.root, ())]
    assert not cache.root.pages and not cache.root.key
    while stack:
        node, prefix = stack.pop()
        assert node.lock_ref >= sum(c.lock_ref for c in node.children.values())
        for key, child in node.children.items():
            assert child.parent is node
            assert len(child.key) > 0 and len(child.key) == len(child.pages) * ps
            assert key == (child.key[0] if ps == 1 else child.key[:ps])
            full = prefix + child.key
            for i, page in enumerate(child.pages):
                out[full[: len(prefix) + (i + 1) * ps]] = page
            stack.append((child, full))
    return out


def walk_evictable(cache: RadixCache) -> int:
    total, stack = 0, [cache.root]
    while stack:
        n = stack.pop()
        total += len(n.pages) if n.lock_ref == 0 else 0
        stack.extend(n.children.values())
    return total


def make_seq(rng: random.Random, pool: List[Tokens], vocab: int, max_len: int) -> Tokens:
    """Often an earlier sequence cut anywhere (also mid-page) plus a random tail, so prefixes collide."""
    if pool and rng.random() < 0.75:
        base = rng.choice(pool)
        base = base[: rng.randint(0, len(base))]
    else:
        base = ()
    tail = tuple(rng.randrange(vocab) for _ in range(rng.randint(0, max_len)))
    return (base + tail)[:max_len]


def insert_fresh(cache: RadixCache, alloc: PageAllocator, seq: Sequence[int]) -> List[int]:
    """Insert seq with newly allocated pages and drop the test's own references, so the tree is the only holder."""
    pages = alloc.alloc(len(seq) // cache.page_size)
    cache.insert(seq, pages)
    alloc.free(pages)
    return pages


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


# ---------------------------------------------------------------------------------------------------------------
# eviction scenarios


def test_evict_lru_order_and_exact_count() -> None:
    alloc = PageAllocator(16)
    cache = RadixCache(alloc, 2)
    a, b, c = (1, 2, 3, 4), (5, 6, 7, 8), (9, 10, 11, 12)
    for s in (a, b, c):
        insert_fresh(cache, alloc, s)
    assert cache.match_prefix(a).num_tokens == 4  # a is now the most recent; b the least
    assert cache.evict(2) == 2
    assert [cache.match_prefix(s).num_tokens for s in (a, b, c)] == [4, 0, 4]
    # those matches refreshed a and then c: a is now the least recent. Asking for one page trims a's last page only
    assert cache.evict(1) == 1
    assert cache.num_pages == 3 and alloc.num_free == 13
    assert [cache.match_prefix(s).num_tokens for s in (c, a)] == [4, 2]
    assert cache.evict(100) == 3
    assert cache.num_pages == 0 and alloc.num_free == 16
    assert cache.evict(1) == 0


def test_parent_becomes_evictable_after_children() -> None:
    alloc = PageAllocator(16)
    cache = RadixCache(alloc, 2)
    p12 = insert_fresh(cache, alloc, (1, 2, 3, 4))  # t1
    p56 = insert_fresh(cache, alloc, (1, 2, 5, 6))  # t2: splits; [1,2] and [5,6] at t2, [3,4] stays at t1
    insert_fresh(cache, alloc, (7, 8))  # t3
    assert cache.num_pages == 4
    assert cache.match_prefix((1, 2, 5, 6)).pages == [p12[0], p56[1]]  # first inserter's [1,2]; t4 on that path
    assert cache.match_prefix((7, 8)).num_tokens == 2  # t5
    # one call: [3,4] (t1), [5,6] (t4), then their parent [1,2] (t4), a leaf by then, before [7,8] (t5)
    assert cache.evict(3) == 3
    assert cache.match_prefix((1, 2)).num_tokens == 0 and cache.match_prefix((7, 8)).num_tokens == 2
    assert cache.num_pages == 1 and alloc.num_free == 15

    # the same tree with [7,8] the oldest: it goes first, and the parent outlives its children when asked for 3
    alloc = PageAllocator(16)
    cache = RadixCache(alloc, 2)
    insert_fresh(cache, alloc, (7, 8))  # t1
    insert_fresh(cache, alloc, (1, 2, 3, 4))  # t2
    insert_fresh(cache, alloc, (1, 2, 5, 6))  # t3
    assert cache.evict(3) == 3
    assert [cache.match_prefix(s).num_tokens for s in ((7, 8), (1, 2, 3, 4), (1, 2, 5, 6))] == [0, 2, 2]
    assert cache.evictable_pages == 1


def test_locked_path_never_evicted() -> None:
    alloc = PageAllocator(16)
    cache = RadixCache(alloc, 1)
    insert_fresh(cache, alloc, (1, 2, 3, 4))
    insert_fresh(cache, alloc, (1, 2, 9))
    insert_fresh(cache, alloc, (5, 6))
    assert cache.evictable_pages == 7
    m = cache.match_prefix((1, 2, 3, 4, 7))
    assert m.num_tokens == 4
    cache.lock(m.node)
    cache.lock(m.node)  # two users
    assert cache.evictable_pages == 3  # [9] and [5,6]; [1,2] and [3,4] are on the locked path
    assert cache.evict(100) == 3
    assert cache.num_pages == 4 and cache.evictable_pages == 0
    assert cache.match_prefix((1, 2, 3, 4)).pages == m.pages
    assert all(alloc.refcount(p) == 1 for p in m.pages)
    assert not cache.reset()  # locked: refused, nothing changed
    assert cache.num_pages == 4 and alloc.num_free == 12
    cache.unlock(m.node)
    assert cache.evict(100) == 0 and cache.evictable_pages == 0  # still one user
    cache.unlock(m.node)
    assert cache.evictable_pages == 4
    with pytest.raises(AssertionError):
        cache.unlock(m.node)
    assert cache.evictable_pages == 4
    assert cache.evict(100) == 4
    assert cache.reset() and alloc.num_free == 16


def test_lock_below_unlocked_subtree_counts() -> None:
    """A locked node's unlocked descendants stay evictable; locking the root (an empty match) protects nothing."""
    alloc = PageAllocator(16)
    cache = RadixCache(alloc, 2)
    insert_fresh(cache, alloc, (1, 2, 3, 4, 5, 6))
    m = cache.match_prefix((1, 2, 9, 9))  # splits after [1,2]
    cache.lock(m.node)
    assert cache.evictable_pages == 2
    root = cache.match_prefix((7, 7)).node
    cache.lock(root)
    assert cache.evictable_pages == 2
    assert cache.evict(100) == 2 and cache.match_prefix((1, 2, 3, 4)).num_tokens == 2
    cache.unlock(root)
    cache.unlock(m.node)
    assert cache.evictable_pages == 1


def test_reset_releases_everything() -> None:
    alloc = PageAllocator(32)
    cache = RadixCache(alloc, 4)
    held = alloc.alloc(3)  # the test keeps a reference on these across the reset
    cache.insert(tuple(range(12)), held)
    insert_fresh(cache, alloc, (0, 1, 2, 3, 9, 9, 9, 9))
    assert cache.num_pages == 4 and alloc.num_free == 32 - 4
    assert cache.reset()
    assert cache.num_pages == 0 and cache.evictable_pages == 0 and cache.match_prefix(tuple(range(12))).num_tokens == 0
    assert [alloc.refcount(p) for p in held] == [1, 1, 1]
    alloc.free(held)
    assert alloc.num_free == 32


# ---------------------------------------------------------------------------------------------------------------
# splits and partial pages


def test_match_mid_node_splits_and_keeps_pages() -> None:
    alloc = PageAllocator(16)
    cache = RadixCache(alloc, 2)
    pages = insert_fresh(cache, alloc, tuple(range(1, 9)))  # one node, 4 pages
    deep = cache.match_prefix(tuple(range(1, 9))).node
    cache.lock(deep)
    assert cache.evictable_pages == 0
    m = cache.match_prefix((1, 2, 3, 4, 9, 9))  # ends inside `deep`'s node: splits it
    assert (m.num_tokens, m.pages) == (4, pages[:2])
    cache.unlock(deep)  # the handle taken before the split still releases both halves
    assert cache.evictable_pages == 4
    cache.lock(m.node)  # the new node covers exactly the match: only its 2 pages are protected
    assert cache.evictable_pages == 2
    assert cache.match_prefix(tuple(range(1, 9))).pages == pages
    assert cache.match_prefix((1, 2, 3, 4, 5, 6, 0)).pages == pages[:3]
    assert cache.match_prefix((1, 2, 3)).pages == pages[:1]  # a partial last page is never matched
    assert cache.match_prefix((1, 2, 3, 4, 5, 6, 7, 8, 9)).pages == pages
    assert cache.evict(10) == 2  # [5..8] only; the locked half stays
    assert cache.match_prefix(tuple(range(1, 9))).pages == pages[:2]
    cache.unlock(m.node)
    assert cache.evict(10) == 2 and alloc.num_free == 16


def test_insert_diverging_mid_page_shares_whole_pages_only() -> None:
    alloc = PageAllocator(16)
    cache = RadixCache(alloc, 4)
    a = alloc.alloc(2)
    assert cache.insert((1, 2, 3, 4, 5, 6, 7, 8), a) == (0, cache.match_prefix((1, 2, 3, 4, 5, 6, 7, 8)).node)
    b = alloc.alloc(2)
    cached, node = cache.insert((1, 2, 3, 4, 5, 6, 99, 99), b)
    assert cached == 4  # [5,6] is shared but not a whole page
    assert [alloc.refcount(p) for p in a] == [2, 2]
    assert [alloc.refcount(p) for p in b] == [1, 2]  # b[0] was not adopted, b[1] was
    assert cache.match_prefix((1, 2, 3, 4, 5, 6, 99, 99)).pages == [a[0], b[1]]
    assert cache.match_prefix((1, 2, 3, 4, 5, 6, 7, 8)).pages == a
    assert cache.match_prefix((1, 2, 3, 4, 5, 6, 7)).pages == [a[0]]
    assert cache.num_pages == 3
    cache.lock(node)
    assert cache.evictable_pages == 1
    cache.unlock(node)
    # inserting an already cached sequence adopts nothing
    assert cache.insert((1, 2, 3, 4), [b[0]])[0] == 4 and alloc.refcount(b[0]) == 1
    alloc.free(a + b)
    assert alloc.num_free == 16 - 3
    assert cache.evict(10) == 3 and alloc.num_free == 16


@pytest.mark.parametrize("tokens,n_pages", [((1, 2, 3), 1), ((1, 2), 2), ((1, 2, 3, 4), 1), ((), 1)])
def test_insert_length_mismatch_raises(tokens: Tokens, n_pages: int) -> None:
    alloc = PageAllocator(8)
    cache = RadixCache(alloc, 2)
    pages = alloc.alloc(n_pages)
    with pytest.raises(ValueError):
        cache.insert(tokens, pages)
    assert cache.num_pages == 0 and all(alloc.refcount(p) == 1 for p in pages)


def test_empty_insert_and_match() -> None:
    alloc = PageAllocator(4)
    cache = RadixCache(alloc, 2)
    assert cache.insert((), []) == (0, cache.root)
    m = cache.match_prefix((5,))
    assert (m.pages, m.num_tokens, m.node) == ([], 0, cache.root)
