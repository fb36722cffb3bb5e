"""A request's memory: its KV pages, its row of the request->token table, and its share of the radix prefix tree.
The scheduler decides who runs; this is how pages and rows are taken, shared and given back. It never touches
model tensors. Where the model's windowed layers keep only their window, `windows` (window.py) keeps their pages
beside the full ones."""
from __future__ import annotations

from typing import List, Optional

import torch

from minisrv.kvcache import PageAllocator, ReqToTokenTable, slots_for
from minisrv.kvcache.radix import PrefixMatch, RadixCache
from minisrv.utils import ceil_div

from ..request import Request
from .window import WindowPages


class CacheManager:
    def __init__(self, allocator: PageAllocator, table: ReqToTokenTable, page_size: int,
                 tree: Optional[RadixCache], windows: Optional[WindowPages] = None) -> None:
        self.alloc = allocator
        self.table = table
        self.page_size = page_size
        self.tree = tree  # the radix prefix cache, or None when disabled
        self.windows = windows

    def pages_for(self, num_tokens: int) -> int:
        return ceil_div(num_tokens, self.page_size)

    def full_pages_available(self) -> int:
        """Pages that can be handed out now: free ones and those only the prefix tree holds."""
        return self.alloc.num_free + (self.tree.evictable_pages if self.tree is not None else 0)

    def available_pages(self) -> int:
        """Pages that can be handed out now, with as many windowed pages beside them where there are such."""
        full = self.full_pages_available()
        return full if self.windows is None else min(full, self.windows.available())

    def alloc_pages(self, n: int) -> List[int]:
        """n pages, evicting from the prefix tree what the free ones lack."""
        short = n - self.alloc.num_free
        if short > 0 and self.tree is not None:
            self.tree.evict(short)
        return self.alloc.alloc(n)

    def match(self, req: Request) -> Optional[PrefixMatch]:
        """The cached prefix a waiting request can start from (its last token is always computed)."""
        if self.tree is None or req.solo or req.params.prompt_logprobs is not None or \
                (req.embedding is not None and req.embedding.mean):
            return None  # prompt logprobs and mean pooling need every prompt position computed
        ids = req.all_ids[:req.total_len - 1]
        m = self.tree.match_prefix(ids)
        if self.windows is not None and m.num_tokens:  # only as far as the windowed K/V it reads is cached
            usable = self.windows.usable_tokens(m)
            if usable < m.num_tokens:
                m = self.tree.match_prefix(ids[:usable])
        return m if m.num_tokens else None

    def admit(self, req: Request, match: Optional[PrefixMatch]) -> None:
        """Give a request admitted to run its table row and, when it starts from a cached prefix, that prefix's
        pages (shared, and held in the tree while it runs)."""
        req.row = self.table.alloc_row()
        if match is not None:
            self.alloc.incref(match.pages)
            self.tree.lock(match.node)
            req.pages, req.cache_node, req.num_cached = list(match.pages), match.node, match.num_tokens
            self.table.write(req.row, 0, slots_for(req.pages, self.page_size, 0, match.num_tokens))
            if self.windows is not None:
                self.windows.admit(req, match)

    def place(self, req: Request, n: int) -> torch.Tensor:
        """Give req the pages and table entries for its next n tokens; returns their slots."""
        start = req.num_cached
        extra = self.pages_for(start + n) - len(req.pages)
        if extra > 0:
            req.pages.extend(self.alloc_pages(extra))
        slots = slots_for(req.pages, self.page_size, start, start + n)
        self.table.write(req.row, start, slots)
        if self.windows is not None:
            self.windows.place(req, start, n)
        return slots

    def decode_pages(self, reqs: List[Request]) -> int:
        """Pages a decode step of reqs takes: one for each request whose next token starts a page."""
        return sum(1 for r in reqs if r.num_cached % self.page_size == 0)

    def place_decode(self, reqs: List[Request]) -> List[int]:
        """The slot of each request's next token, written to the table; the caller made sure the pages are there."""
        ps = self.page_size
        fresh = self.alloc_pages(self.decode_pages(reqs))
        slots = []
        for r in reqs:
            pos = r.num_cached
            if pos % ps == 0:
                r.pages.append(fresh.pop())
            slots.append(r.pages[pos // ps] * ps + pos % ps)
        self.table.write_points([r.row for r in reqs], [r.num_cached for r in reqs], slots)
        if self.windows is not None:
            self.windows.place_decode(reqs)
        return slots

    def verify_pages(self, reqs: List[Request], drafts: List[List[int]]) -> int:
        """Pages a verify step of reqs takes: those for each request's last token and its draft."""
        return sum(max(0, self.pages_for(r.num_cached + 1 + len(d)) - len(r.pages)) for r, d in zip(reqs, drafts))

    def rollback(self, req: Request, num_tokens: int) -> None:
        """The request's last num_tokens computed positions held drafts the target rejected: they no longer count
        as cached, and the pages past its new end go back (its table entries there are rewritten before use)."""
        req.num_cached -= num_tokens
        keep = self.pages_for(req.num_cached)
        if len(req.pages) > keep:
            self.alloc.free(req.pages[keep:])
            del req.pages[keep:]
            if self.windows is not None:
                self.windows.truncate(req)

    def release(self, req: Request, keep_kv: bool = True) -> None:
        """Drop a request's pages and row; with the tree on, its computed full pages are kept in the tree first
        (keep_kv False: its KV is not to be trusted, after a failed step)."""
        if self.tree is not None:
            full = min(req.num_cached, len(req.prompt_ids) + len(req.output_ids)) // self.page_size
            if keep_kv and full:
                self.tree.insert(req.all_ids[:full * self.page_size], req.pages[:full], req.window_pages[:full])
            if req.cache_node is not None:
                self.tree.unlock(req.cache_node)
                req.cache_node = None
        self.alloc.free(req.pages)
        req.pages = []
        if self.windows is not None:
            self.windows.truncate(req)
        req.num_cached = 0
        if req.row >= 0:
            self.table.free_row(req.row)
            req.row = -1

    def cache_prefix(self, req: Request) -> None:
        """Put a running request's computed full pages in the tree now (so requests admitted later share them while
        it runs), and hold the tree's path to them instead of the one it held."""
        if self.tree is None:
            return
        full = req.num_cached // self.page_size
        if not full:
            return
        _, node = self.tree.insert(req.all_ids[:full * self.page_size], req.pages[:full], req.window_pages[:full])
        if node is not req.cache_node:
            self.tree.lock(node)
            if req.cache_node is not None:
                self.tree.unlock(req.cache_node)
            req.cache_node = node

    def flush(self) -> bool:
        """Empty the prefix tree (refused, False, while a request holds part of it)."""
        return self.tree is None or self.tree.reset()
