"""Pages of the KV pool handed out and taken back, with reference counts so that requests and the radix prefix
tree can share a prefix's pages: a page returns to the free stack only when nobody holds it."""
from __future__ import annotations

from typing import List


class PageAllocator:
    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self._free: List[int] = list(range(num_pages - 1, -1, -1))  # pop() hands out low pages first
        self._refs = [0] * num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> List[int]:
        if n > len(self._free):
            raise MemoryError(f"KV pool exhausted: asked for {n} pages, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self._refs[p] = 1
        return pages

    def incref(self, pages: List[int]) -> None:
        for p in pages:
            assert self._refs[p] > 0, f"incref of free page {p}"
            self._refs[p] += 1

    def free(self, pages: List[int]) -> None:
        for p in pages:
            r = self._refs[p]
            assert r > 0, f"double free of page {p}"
            self._refs[p] = r - 1
            if r == 1:
                self._free.append(p)

    def refcount(self, page: int) -> int:
        return self._refs[page]
