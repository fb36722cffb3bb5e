"""The radix prefix cache: a tree over token ids, at page granularity, that keeps the KV pages of finished and
running requests so that a later request starting with the same tokens reuses them instead of recomputing them.
Many requests share a prefix: the same system prompt, the same few-shot examples, or, in a multi-turn chat, the
whole conversation so far, which each new turn resends with a few more tokens at the end.

Invariants:
  * Every non-root node holds a non-empty tuple of token ids whose length is a multiple of `page_size`, and the
    matching pages (one per `page_size` tokens); the root holds nothing and is never evicted.
  * A node's children are keyed by their first page of tokens (a tuple of `page_size` ids; the bare id when
    `page_size` is 1), so siblings never share a first page, and a path from the root spells a cached prefix.
  * The tree holds exactly one allocator reference on each page in it; requests hold their own references.
  * A node's lock count is the number of locks taken on it or on any node below it (`lock` walks up to the root),
    so a node with lock count 0 has no user in its subtree, and the pages of such nodes are `evictable_pages`.
  * A node's last-access tick is never older than any of its descendants' (every access refreshes the whole path),
    so evicting least-recently-used leaves first removes deep, cold suffixes before the prefixes they hang from.
  * With a `window_allocator` (the windowed layers' own pages: pool.py), each node also holds, page for page, the
    windowed pages of its tokens, or None where it gave one back (`evict_windows`, any node, least recently used
    first, locked or not: a running request holds its own references to the windowed pages it reads). The tree holds
    one reference on each it has; a match says which are there, for the caller to shorten it (window.py).
"""
from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import Dict, Hashable, List, Optional, Sequence, Tuple

from minisrv.kvcache.allocator import PageAllocator

_serials = itertools.count()


@dataclass(eq=False)
class RadixNode:
    key: Tuple[int, ...] = ()
    pages: List[int] = field(default_factory=list)
    window_pages: List[Optional[int]] = field(default_factory=list)  # beside `pages`, with a window allocator
    parent: Optional["RadixNode"] = None
    children: Dict[Hashable, "RadixNode"] = field(default_factory=dict)
    lock_ref: int = 0
    last_access: int = 0
    serial: int = field(default_factory=lambda: next(_serials))  # breaks LRU ties deterministically in the heap


@dataclass
class PrefixMatch:
    pages: List[int]  # the cached prefix's pages, in order
    num_tokens: int  # == len(pages) * page_size
    node: RadixNode  # the deepest node of the match (the root when nothing matched); pass to lock/unlock
    window_pages: List[Optional[int]] = field(default_factory=list)  # beside pages, with a window allocator


class RadixCache:
    """Prefix tree of cached KV pages. Not thread safe: the scheduler owns it."""

    def __init__(self, allocator: PageAllocator, page_size: int,
                 window_allocator: Optional[PageAllocator] = None) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.allocator = allocator
        self.window_allocator = window_allocator
        self.page_size = page_size
        self.root = RadixNode()
        self._clock = 0
        self.num_pages = 0  # pages the tree holds
        self.evictable_pages = 0  # of those, the pages of unlocked nodes

    @property
    def num_tokens(self) -> int:
        return self.num_pages * self.page_size

    def match_prefix(self, token_ids: Sequence[int]) -> PrefixMatch:
        """The longest cached prefix of token_ids that is a whole number of pages. Refreshes LRU times on the path
        and splits the last node if the match ends inside it; changes no reference count."""
        tokens = tuple(token_ids)
        tokens = tokens[: len(tokens) - len(tokens) % self.page_size]
        node, pos, path = self._walk(tokens)
        return PrefixMatch([p for n in path for p in n.pages], pos, node,
                           [p for n in path for p in n.window_pages] if self.window_allocator is not None else [])

    def insert(self, token_ids: Sequence[int], pages: Sequence[int],
               window_pages: Sequence[Optional[int]] = ()) -> Tuple[int, RadixNode]:
        """Cache token_ids (a whole number of pages) with their pages (and, with a window allocator, their windowed
        pages, None where the caller has none). The tree takes one new reference on each page it adopts (those past
        the already-cached prefix, and windowed pages where the cached prefix has none); the caller keeps its own
        references to all of them. Returns (number of tokens already cached, the node ending at token_ids)."""
        tokens = tuple(token_ids)
        if len(tokens) != len(pages) * self.page_size:
            raise ValueError(f"{len(tokens)} tokens do not fill {len(pages)} pages of {self.page_size}")
        node, pos, path = self._walk(tokens)
        new_windows: List[Optional[int]] = []
        if self.window_allocator is not None:
            self._fill_windows(path, window_pages)
            new_windows = list(window_pages[pos // self.page_size:])
            self.window_allocator.incref([p for p in new_windows if p is not None])
        if pos < len(tokens):
            new_pages = list(pages[pos // self.page_size:])
            self.allocator.incref(new_pages)
            leaf = RadixNode(key=tokens[pos:], pages=new_pages, window_pages=new_windows, parent=node,
                             last_access=self._clock)
            node.children[self._child_key(leaf.key)] = leaf
            self.num_pages += len(new_pages)
            self.evictable_pages += len(new_pages)
            node = leaf
        return pos, node

    def lock(self, node: RadixNode) -> None:
        """Protect node and its ancestors from eviction until the matching unlock. O(depth)."""
        n: Optional[RadixNode] = node
        while n is not None:
            if n.lock_ref == 0:
                self.evictable_pages -= len(n.pages)
            n.lock_ref += 1
            n = n.parent

    def unlock(self, node: RadixNode) -> None:
        """Undo one lock of node. O(depth)."""
        assert node.lock_ref > 0, "unlock of a node that is not locked"
        n: Optional[RadixNode] = node
        while n is not None:
            n.lock_ref -= 1
            if n.lock_ref == 0:
                self.evictable_pages += len(n.pages)
            n = n.parent

    def evict(self, num_pages: int) -> int:
        """Release the tree's reference on up to num_pages pages of unlocked leaves, least recently used leaf first;
        a leaf is trimmed from its end, so exactly min(num_pages, evictable_pages) pages are released. Returns that."""
        heap = [(n.last_access, n.serial, n) for n in self._nodes() if self._is_evictable_leaf(n)]
        heapq.heapify(heap)
        released = 0
        while released < num_pages and heap:
            _, _, leaf = heapq.heappop(heap)
            first_page = self._child_key(leaf.key)
            take = min(num_pages - released, len(leaf.pages))
            keep = len(leaf.pages) - take
            self.allocator.free(leaf.pages[keep:])
            self._free_windows(leaf.window_pages[keep:])
            leaf.pages, leaf.window_pages = leaf.pages[:keep], leaf.window_pages[:keep]
            leaf.key = leaf.key[: keep * self.page_size]
            released += take
            self.num_pages -= take
            self.evictable_pages -= take
            if keep == 0:
                parent = leaf.parent
                assert parent is not None
                del parent.children[first_page]
                leaf.parent = None
                if self._is_evictable_leaf(parent):
                    heapq.heappush(heap, (parent.last_access, parent.serial, parent))
        return released

    def evict_windows(self, num_free: int) -> None:
        """Give back the tree's windowed pages, least recently used node first, until the window allocator has
        num_free free pages or the tree holds none (a page a request also holds frees nothing yet)."""
        nodes = sorted((n for n in self._nodes() if any(p is not None for p in n.window_pages)),
                       key=lambda n: (n.last_access, n.serial))
        for n in nodes:
            for i, p in enumerate(n.window_pages):
                if self.window_allocator.num_free >= num_free:
                    return
                if p is not None:
                    self.window_allocator.free([p])
                    n.window_pages[i] = None

    def reset(self) -> bool:
        """Release every page the tree holds and empty it; refused (False) while any node is locked."""
        if self.root.lock_ref > 0:
            return False
        for n in self._nodes():
            self.allocator.free(n.pages)
            self._free_windows(n.window_pages)
        self.root = RadixNode()
        self.num_pages = 0
        self.evictable_pages = 0
        return True

    def _free_windows(self, window_pages: List[Optional[int]]) -> None:
        if window_pages:
            self.window_allocator.free([p for p in window_pages if p is not None])

    def _fill_windows(self, path: List[RadixNode], window_pages: Sequence[Optional[int]]) -> None:
        """Adopt the caller's windowed pages where the cached nodes of its path gave theirs back."""
        i = 0
        for n in path:
            for j, p in enumerate(n.window_pages):
                if p is None and window_pages[i + j] is not None:
                    n.window_pages[j] = window_pages[i + j]
                    self.window_allocator.incref([n.window_pages[j]])
            i += len(n.pages)

    def _walk(self, tokens: Tuple[int, ...]) -> Tuple[RadixNode, int, List[RadixNode]]:
        """Follow tokens down the tree as far as whole pages match, splitting the node where the match ends inside
        it; refresh LRU times on the way. Returns (node, tokens, the matched nodes from the root's child down)."""
        self._clock += 1
        node, pos, path = self.root, 0, []
        node.last_access = self._clock
        while pos < len(tokens):
            child = node.children.get(self._child_key(tokens, pos))
            if child is None:
                break
            common = self._common_tokens(child.key, tokens, pos)
            if common < len(child.key):
                child = self._split(child, common)
            child.last_access = self._clock
            path.append(child)
            node, pos = child, pos + common
        return node, pos, path

    def _split(self, node: RadixNode, at: int) -> RadixNode:
        """Cut node after `at` tokens (a page multiple); the new upper node is returned and node keeps the tail,
        so a caller's lock handle on node still ends where it did. Lock counts and evictable totals are unchanged."""
        parent = node.parent
        assert parent is not None and 0 < at < len(node.key) and at % self.page_size == 0
        cut = at // self.page_size
        upper = RadixNode(key=node.key[:at], pages=node.pages[:cut], window_pages=node.window_pages[:cut],
                          parent=parent, lock_ref=node.lock_ref, last_access=node.last_access)
        parent.children[self._child_key(upper.key)] = upper
        node.key, node.pages, node.window_pages, node.parent = \
            node.key[at:], node.pages[cut:], node.window_pages[cut:], upper
        upper.children[self._child_key(node.key)] = node
        return upper

    def _common_tokens(self, key: Tuple[int, ...], tokens: Tuple[int, ...], pos: int) -> int:
        """Length of the common prefix of key and tokens[pos:], floored to whole pages.

        Compared a slice at a time (C loops, not one Python step per token): a walk usually matches whole nodes,
        which one comparison settles; otherwise the count of equal leading pages is found by bisection, comparing
        only the pages not yet known to be equal, so the cost stays about two passes over the key."""
        n = len(key)
        if tokens[pos:pos + n] == key:
            return n
        ps = self.page_size
        lo, hi = 0, min(n, len(tokens) - pos) // ps  # the number of equal leading pages is in [lo, hi]
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if key[lo * ps:mid * ps] == tokens[pos + lo * ps:pos + mid * ps]:
                lo = mid
            else:
                hi = mid - 1
        return lo * ps

    def _child_key(self, tokens: Tuple[int, ...], pos: int = 0) -> Hashable:
        """The key of the child starting at tokens[pos]: its first page of tokens (the bare id for page_size 1)."""
        return tokens[pos] if self.page_size == 1 else tokens[pos: pos + self.page_size]

    def _is_evictable_leaf(self, n: RadixNode) -> bool:
        return n is not self.root and not n.children and n.lock_ref == 0

    def _nodes(self) -> List[RadixNode]:
        """Every non-root node, parents before children."""
        out: List[RadixNode] = []
        stack = list(self.root.children.values())
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(n.children.values())
        return out
