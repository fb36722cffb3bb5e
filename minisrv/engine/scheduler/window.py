"""The windowed layers' own KV pages of running requests, for a model whose sliding-window layers keep only their
window (kvcache/pool.py, kvcache/window.py).

A request holds, beside each of its pages, the windowed page of the same positions while a query of its may still
read it: `trim`, at the start of each step's scheduling (when every request's cached length is settled: a verify
step's rejected drafts are rolled back by then), gives back those wholly before its next query's window. New pages
come in pairs, so a step needs as many windowed pages as full ones; `available` is a floor on the windowed pages that
can be handed out: every page no request holds is free or held by the prefix tree only, which gives its windowed
pages back, least recently used first, when the free ones run short.
"""
from __future__ import annotations

from typing import List, Optional

from minisrv.kvcache import PageAllocator, ReqToTokenTable, WindowRule, slots_for
from minisrv.kvcache.radix import PrefixMatch, RadixCache

from ..request import Request


class WindowPages:
    def __init__(self, allocator: PageAllocator, table: ReqToTokenTable, rule: WindowRule,
                 tree: Optional[RadixCache]) -> None:
        self.alloc = allocator
        self.table = table
        self.rule = rule
        self.tree = tree
        self.held = 0  # references running requests hold (a page two requests share counts twice)

    def available(self) -> int:
        return max(self.alloc.num_free, self.alloc.num_pages - self.held)

    @property
    def span(self) -> int:
        """The most windowed pages a request holds as it decodes: those its window touches and the next one."""
        return -(-(self.rule.window - 1) // self.rule.page_size) + 1

    def reserve(self, req: Request, future_pages: int) -> int:
        """Windowed pages req takes as it decodes future_pages more pages: until it holds its span."""
        return min(future_pages, max(0, self.span - (len(req.window_pages) - req.window_lo)))

    def usable_tokens(self, match: PrefixMatch) -> int:
        """How much of a cached prefix a request can continue from (window.py)."""
        return self.rule.usable_pages(match.window_pages) * self.rule.page_size

    def admit(self, req: Request, match: PrefixMatch) -> None:
        """Share the windowed pages of the last window of a cached prefix (usable_tokens long) with req."""
        end = len(match.pages)
        lo = self.rule.first_page(match.num_tokens)
        kept = match.window_pages[lo:end]
        self.alloc.incref(kept)
        self.held += len(kept)
        req.window_pages, req.window_lo = [None] * lo + kept, lo
        ps = self.rule.page_size
        self.table.write(req.row, lo * ps, slots_for(req.window_pages, ps, lo * ps, match.num_tokens), window=True)

    def trim(self, reqs: List[Request]) -> None:
        for r in reqs:
            lo = min(self.rule.first_page(r.num_cached), len(r.window_pages))
            if lo > r.window_lo:
                self._drop(r.window_pages[r.window_lo:lo])
                r.window_pages[r.window_lo:lo] = [None] * (lo - r.window_lo)
                r.window_lo = lo

    def place(self, req: Request, start: int, n: int) -> None:
        """The windowed pages and table entries of positions [start, start + n), beside the full ones placed."""
        self._grow(req)
        ps = self.rule.page_size
        self.table.write(req.row, start, slots_for(req.window_pages, ps, start, start + n), window=True)

    def place_decode(self, reqs: List[Request]) -> None:
        ps = self.rule.page_size
        slots = []
        for r in reqs:
            self._grow(r)
            slots.append(r.window_pages[r.num_cached // ps] * ps + r.num_cached % ps)
        self.table.write_points([r.row for r in reqs], [r.num_cached for r in reqs], slots, window=True)

    def truncate(self, req: Request) -> None:
        """Give back the windowed pages past the request's full ones (after a rollback, or all at release)."""
        keep = len(req.pages)
        self._drop(req.window_pages[keep:])
        del req.window_pages[keep:]
        req.window_lo = min(req.window_lo, keep)

    def _grow(self, req: Request) -> None:
        """Windowed pages beside each of req's full pages."""
        n = len(req.pages) - len(req.window_pages)
        if n > 0:
            if n > self.alloc.num_free and self.tree is not None:  # (a few more: an eviction walks the tree)
                self.tree.evict_windows(max(n, self.alloc.num_pages // 64))
            req.window_pages.extend(self.alloc.alloc(n))
            self.held += n

    def _drop(self, pages: List[Optional[int]]) -> None:
        held = [p for p in pages if p is not None]
        self.alloc.free(held)
        self.held -= len(held)
