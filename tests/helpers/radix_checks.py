"""Checks of a radix prefix cache's structure, shared by the radix tests: the prefixes it spells, the pages no lock
holds, and an insert whose pages only the tree holds."""
from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

from minisrv.kvcache.allocator import PageAllocator
from minisrv.kvcache.radix import RadixCache, RadixNode

Tokens = Tuple[int, ...]


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


def insert_fresh(cache: RadixCache, alloc: PageAllocator, seq: Sequence[int]) -> List[int]:
    """Insert seq with newly allocated pages and drop the test's own references, so the tree is the only holder."""
    pages = alloc.alloc(len(seq) // cache.page_size)
    cache.insert(seq, pages)
    alloc.free(pages)
    return pages
