"""An engine watcher that checks the pool's bookkeeping after every step and records each logits row, and the
checks that a finished engine holds no page. Where the windowed layers keep only their window (their own pages
beside the full ones), those pages are checked the same way, and against the window: each running request holds
exactly the windowed pages its next query's window reaches, and its window table row maps them."""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple

import torch

from .hf_reference import hf_logits, rel_err


class EngineWatch:
    """Wraps an engine's step (and its allocator) to check, after every step, that pages and table rows are
    accounted for exactly once, and records every logits row the runner computes for a sampling request."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.steps = 0
        self.outstanding: set = set()  # pages handed out and not yet returned to the free stack
        self.logits: Dict[str, List[Tuple[int, torch.Tensor]]] = {}  # rid -> [(position, logits row)]
        self.modes: List[str] = []
        self.partial_extends = 0  # extend rows that stopped short of the end of their sequence (chunked prefill)
        self.reqs: Dict[str, object] = {}  # every request seen in a batch
        self._batch = None
        self.outstanding = _watch_allocator(engine.parts.allocator)
        self.window_rule = engine.parts.window_rule
        if self.window_rule is not None:
            self.window_outstanding = _watch_allocator(engine.parts.window_allocator)

        runner = engine.runner
        orig_step, orig_fwd = runner.launch, runner.forward_logits

        def runner_step(sb, *args, **kwargs):
            self._batch = sb
            self._check_batch(sb)
            return orig_step(sb, *args, **kwargs)

        def forward_logits(fb, aux=None):
            out = orig_fwd(fb, aux)
            sb = self._batch
            if sb is not None and sb.drafts is None:  # (a verify step's rows include rejected drafts)
                for i, (r, n) in enumerate(zip(sb.reqs, sb.extend_lens)):
                    self.logits.setdefault(r.rid, []).append((r.num_cached + n - 1, out[i].detach().clone()))
            return out

        runner.launch = runner_step
        runner.forward_logits = forward_logits
        orig_engine_step = engine.step

        def engine_step():
            outs = orig_engine_step()
            self.steps += 1
            self.check()
            return outs

        engine.step = engine_step

    def _check_batch(self, sb) -> None:
        ps = self.engine.parts.pool.page_size
        self.modes.append(sb.mode.value)
        self.partial_extends += sum(1 for s in sb.samples if not s)
        for r in sb.reqs:
            self.reqs[r.rid] = r
        loc = sb.out_cache_loc.tolist()
        assert len(loc) == sum(sb.extend_lens) and len(set(loc)) == len(loc), "a slot written twice in one step"
        i = 0
        for r, n in zip(sb.reqs, sb.extend_lens):
            mine = loc[i:i + n]
            i += n
            owned = set(r.pages)
            assert all(s // ps in owned for s in mine), f"{r.rid} writes slots outside its own pages"
            expect = [r.pages[p // ps] * ps + p % ps for p in range(r.num_cached, r.num_cached + n)]
            assert mine == expect, f"{r.rid}: slots {mine} are not its positions' slots {expect}"
        if self.window_rule is not None:  # scheduled: the windowed pages behind each request's window are back
            for r in self.engine.scheduler.running:
                lo = min(self.window_rule.first_page(r.num_cached), len(r.window_pages))
                assert r.window_lo == lo, f"{r.rid} holds windowed pages from {r.window_lo}, its window from {lo}"
            table, alloc = self.engine.parts.table.window_table, self.engine.parts.window_allocator
            for r, n in zip(sb.reqs, sb.extend_lens):  # its new K/V go to windowed pages of its own alone
                pages = {r.window_pages[p // ps] for p in range(r.num_cached, r.num_cached + n)}
                assert all(alloc.refcount(p) == 1 for p in pages), f"{r.rid} writes a shared windowed page"
                want = [r.window_pages[p // ps] * ps + p % ps for p in range(r.num_cached, r.num_cached + n)]
                assert table[r.row, r.num_cached:r.num_cached + n].tolist() == want, f"{r.rid}: window slots"

    def check(self) -> None:
        eng = self.engine
        sched, alloc, table = eng.scheduler, eng.parts.allocator, eng.parts.table
        ps = eng.parts.pool.page_size
        owned: Dict[int, str] = {}
        holders: Dict[int, int] = {}  # page -> requests holding it (a cached prefix is shared)
        tree = tree_pages(eng)
        rows = set()
        free_rows = set(table._free_rows)
        for r in sched.running:
            assert r.status.value == "running"
            assert r.row >= 0 and r.row not in rows and r.row not in free_rows and r.row != eng.parts.pad_row, \
                f"{r.rid} has a bad or shared table row {r.row}"
            rows.add(r.row)
            assert len(r.pages) == -(-r.num_cached // ps), \
                f"{r.rid}: {len(r.pages)} pages for {r.num_cached} cached tokens"
            for i, p in enumerate(r.pages):
                if p in owned:  # only a prefix from the cache is shared, and it is read-only: whole pages
                    assert p in tree and (i + 1) * ps <= r.num_cached, f"page {p} of {owned[p]} and {r.rid}"
                owned[p] = r.rid
                holders[p] = holders.get(p, 0) + 1
            if r.num_cached:
                slots = [r.pages[q // ps] * ps + q % ps for q in range(r.num_cached)]
                assert table.table[r.row, :r.num_cached].tolist() == slots, f"{r.rid}: table row disagrees"
        for r in sched.waiting:
            assert r.status.value == "waiting" and not r.pages and r.row == -1 and r.num_cached == 0
        for p in set(owned) | tree:
            want = holders.get(p, 0) + (p in tree)
            assert alloc.refcount(p) == want, f"page {p} has refcount {alloc.refcount(p)}, held {want} times"
        used = set(owned) | tree
        free = alloc._free
        assert len(set(free)) == len(free), "a page is on the free stack twice"
        assert not set(free) & used, "a page is both free and in use"
        assert len(free) + len(used) == alloc.num_pages, \
            f"{alloc.num_pages - len(free) - len(used)} pages are neither free nor in use (leak)"
        assert self.outstanding == used, "allocator and requests disagree about which pages are in use"
        assert len(free_rows) + len(rows) + 1 == table.table.shape[0], "a table row leaked"
        if self.window_rule is not None:
            self._check_windows()

    def _check_windows(self) -> None:
        eng = self.engine
        alloc, table, ps = eng.parts.window_allocator, eng.parts.table.window_table, eng.parts.page_size
        tree = tree_pages(eng, window=True)
        holders: Dict[int, int] = {}
        for r in eng.scheduler.running:
            assert len(r.window_pages) == len(r.pages), f"{r.rid}: windowed pages beside {len(r.pages)} pages"
            assert all((p is None) == (i < r.window_lo) for i, p in enumerate(r.window_pages)), \
                f"{r.rid}: windowed pages given back out of order"
            assert r.window_lo <= self.window_rule.first_page(r.num_cached), \
                f"{r.rid}: a windowed page it reads is gone"
            for i, p in enumerate(r.window_pages[r.window_lo:], r.window_lo):
                if p in holders:  # shared only as a cached prefix's last window: whole pages, in the tree
                    assert p in tree and (i + 1) * ps <= r.num_cached, f"windowed page {p} shared by {r.rid}"
                holders[p] = holders.get(p, 0) + 1
            start = r.window_lo * ps
            slots = [r.window_pages[q // ps] * ps + q % ps for q in range(start, r.num_cached)]
            assert table[r.row, start:r.num_cached].tolist() == slots, f"{r.rid}: window table row disagrees"
        for p in set(holders) | tree:
            want = holders.get(p, 0) + (p in tree)
            assert alloc.refcount(p) == want, f"windowed page {p}: refcount {alloc.refcount(p)}, held {want} times"
        free = alloc._free
        assert len(set(free)) == len(free) and not set(free) & (set(holders) | tree), "a windowed page free twice"
        assert len(free) + len(set(holders) | tree) == alloc.num_pages, "a windowed page leaked"
        assert self.window_outstanding == set(holders) | tree, "windowed pages in use disagree"
        held = sum(holders.values())
        assert eng.scheduler.cache.windows.held == held, f"{eng.scheduler.cache.windows.held} counted, {held} held"

    def assert_idle(self) -> None:
        eng = self.engine
        assert not eng.scheduler.running and not eng.scheduler.waiting and not eng.scheduler.by_id
        assert_pool_free(eng)

    @property
    def batch(self):
        """The batch of the step being run (the last one run, between steps)."""
        return self._batch

    def errors_against(self, model, prepare: Optional[Callable[[object], None]] = None) -> List[float]:
        """Relative error of every recorded logits row against `model`'s (an HF model's) teacher-forced logits;
        `prepare(request)` is called before each request's forward."""
        errs = []
        for req in self.reqs.values():
            if prepare is not None:
                prepare(req)
            seq = req.prompt_ids + req.output_ids
            with torch.no_grad():
                ref = model(torch.tensor([seq[:-1] if req.output_ids else seq])).logits[0]
            errs += [rel_err(row, ref[pos]) for pos, row in self.logits.get(req.rid, [])]
        return errs

    def check_logits(self, path: str, reqs=None, tol: float = 1e-4) -> int:
        """Every recorded logits row (one per step per request) against HF's teacher-forced float64 logits at the
        same position of the same sequence. Returns how many rows were compared."""
        count = 0
        for req in (self.reqs.values() if reqs is None else reqs):
            rows = self.logits.get(req.rid, [])
            seq = req.prompt_ids + req.output_ids
            ref = hf_logits(path, seq[:-1] if req.output_ids else seq)
            for pos, row in rows:
                err = rel_err(row, ref[pos])
                assert err < tol, f"{req.rid}: logits at position {pos} off by {err:.2e} (relative)"
                count += 1
        return count


def _watch_allocator(alloc) -> set:
    """Wraps alloc's alloc and free to check that no page is handed out twice; returns the set of pages in use,
    which the wrappers keep up to date."""
    outstanding = {p for p in range(alloc.num_pages) if alloc.refcount(p) > 0}
    orig_alloc, orig_free = alloc.alloc, alloc.free

    def checked_alloc(n):
        pages = orig_alloc(n)
        assert len(set(pages)) == len(pages), f"alloc returned a page twice: {pages}"
        again = outstanding.intersection(pages)
        assert not again, f"pages {sorted(again)} handed out while still in use"
        outstanding.update(pages)
        return pages

    def checked_free(pages):
        orig_free(pages)
        for p in pages:
            if alloc.refcount(p) == 0:
                outstanding.discard(p)

    alloc.alloc, alloc.free = checked_alloc, checked_free
    return outstanding


def tree_pages(engine, window: bool = False) -> set:
    """Pages (window: windowed pages) the prefix cache holds (walked independently of its counters)."""
    cache = engine.cache
    if cache is None:
        return set()
    pages, todo = set(), [cache.root]
    while todo:
        n = todo.pop()
        pages.update(p for p in (n.window_pages if window else n.pages) if p is not None)
        todo.extend(n.children.values())
    return pages


def assert_pool_free(engine) -> None:
    """No request holds a page: every page is free or held once by the prefix cache, which holds no lock."""
    tree = tree_pages(engine)
    alloc = engine.parts.allocator
    assert engine.cache is None or engine.cache.root.lock_ref == 0, "a prefix-cache path is still locked"
    assert all(alloc.refcount(p) == 1 for p in tree), "a cached page is still held by a request"
    assert engine.parts.allocator.num_free + len(tree) == engine.parts.allocator.num_pages, \
        f"{engine.parts.allocator.num_pages - engine.parts.allocator.num_free - len(tree)} pages still in use"
    assert engine.parts.table.num_free_rows == engine.parts.table.table.shape[0] - 1, "table rows still in use"
    if engine.parts.window_allocator is not None:
        tree, alloc = tree_pages(engine, window=True), engine.parts.window_allocator
        assert all(alloc.refcount(p) == 1 for p in tree), "a cached windowed page is still held by a request"
        assert alloc.num_free + len(tree) == alloc.num_pages, "windowed pages still in use"
