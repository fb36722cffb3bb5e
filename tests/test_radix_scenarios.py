"""The radix prefix cache in hand-built scenarios whose expected outcomes are worked out by hand: eviction order and
counts, locks, reset, splits mid-node, inserts that diverge mid-page, and malformed inserts."""
from __future__ import annotations

import pytest

from minisrv.kvcache.allocator import PageAllocator
from minisrv.kvcache.radix import RadixCache

from .helpers.radix_checks import Tokens, insert_fresh


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
