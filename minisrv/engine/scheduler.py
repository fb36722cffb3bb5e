"""Who runs next: waiting queue (FCFS, or longest cached prefix first), prefix cache, prefill budget, chunked
prefill, decode, and retraction.

Every request is a sequence of token ids (prompt + output so far), of which the first `num_cached` have K/V in
the pool. A step extends some requests by `n` tokens; when that reaches the end of the sequence, a token is
sampled. Prefill, chunked prefill, re-prefill after retraction and decode are all this one operation.
The scheduler owns pages and rows (through the allocator and the table) but never touches model tensors.
"""
from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from typing import Deque, Dict, List, Optional, Set, Tuple

import torch

from minisrv.batch import ForwardMode
from minisrv.kvcache import PageAllocator, ReqToTokenTable, slots_for
from minisrv.kvcache.radix import PrefixMatch, RadixCache, RadixNode
from minisrv.utils import ceil_div, host_tensor

from .request import Request, RequestError, RequestStatus

logger = logging.getLogger(__name__)

# SGLang-style estimate of how much of their remaining budget running requests will still decode, used to
# keep room for them when admitting new prefills; it decays as decoding goes well and resets on retraction.
INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY = (INIT_NEW_TOKEN_RATIO - MIN_NEW_TOKEN_RATIO) / 600
RESERVE_CLIP = 4096  # no single request reserves more than this many future tokens
SCHEDULE_POLICIES = ("fcfs", "lpm")
LPM_MIN_QUEUE = 8  # lpm orders the queue by cached prefix only when this many wait (short queues stay FCFS)
# a waiting request whose first tokens equal those of a request already in the prefill batch being built, and are
# not cached yet, waits one step: the prefix is then in the tree (inserted when that batch is queued) instead of
# being computed twice in one batch
IN_BATCH_PREFIX = 32
# a request that scores its prompt (prompt logprobs) computes logits at every prompt position, which makes its
# prefill several times dearer than a plain one: it is extended by at most this many tokens a step, and requests
# that decode take a turn between its chunks, so that a long prompt being scored does not stall the others
SCORING_CHUNK = 512


@dataclass
class ScheduledBatch:
    mode: ForwardMode
    reqs: List[Request]
    extend_lens: List[int]
    out_cache_loc: torch.Tensor  # [sum(extend_lens)] int64 slots, on the host
    samples: List[bool] = None  # whether each request reaches the end of its sequence (and samples a token)

    def __post_init__(self) -> None:
        if self.samples is None:
            self.samples = [r.num_cached + n == r.total_len for r, n in zip(self.reqs, self.extend_lens)]


class Scheduler:
    def __init__(self, allocator: PageAllocator, table: ReqToTokenTable, page_size: int, max_running: int,
                 max_prefill_tokens: int, chunked_prefill_size: int, cache: Optional[RadixCache] = None,
                 policy: str = "fcfs") -> None:
        if policy not in SCHEDULE_POLICIES:
            raise ValueError(f"schedule policy must be one of {SCHEDULE_POLICIES}, got {policy!r}")
        self.alloc = allocator
        self.table = table
        self.page_size = page_size
        self.max_running = max_running
        self.max_prefill_tokens = max_prefill_tokens
        self.chunk = chunked_prefill_size
        self.cache = cache  # the radix prefix cache, or None when disabled
        self.policy = policy
        self.waiting: Deque[Request] = deque()
        self.running: List[Request] = []  # resident in the pool, in admission order
        self.by_id: Dict[str, Request] = {}
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO
        self.num_retractions = 0
        self.num_penalized = 0  # live requests using penalties (their sampling needs the real previous tokens)
        self.num_constrained = 0  # live requests with a grammar or thinking budget (need the previous token)
        # lpm's cached-prefix length of each waiting request, valid while the tree's contents and the request's
        # length are those it was measured at: rid -> (request, tree_changes, total_len, cached tokens)
        self.tree_changes = 0  # bumped whenever pages enter or leave the prefix tree
        self._lpm_hits: Dict[str, Tuple[Request, int, int, int]] = {}
        self.decode_turn = False  # the last step was a chunk of a prompt still being scored: decoding goes next

    # ------------------------------------------------------------------ queue
    def add(self, req: Request) -> None:
        if req.rid in self.by_id:
            raise RequestError(f"duplicate request id {req.rid!r}")
        self.waiting.append(req)
        self.by_id[req.rid] = req
        self.num_penalized += req.has_penalties
        self.num_constrained += req.needs_accepted_tokens

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def isolate(self, req: Request) -> None:
        """A step with this request failed: recompute it from scratch, in batches of its own, until it samples."""
        req.solo = True
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
            self._release(req, keep_kv=False)
            req.status = RequestStatus.WAITING
            self.waiting.appendleft(req)

    def abort(self, rid: str) -> Optional[Request]:
        req = self.by_id.get(rid)
        if req is None or req.finished:
            return None
        self.finish(req, "abort")
        return req

    def finish(self, req: Request, reason: str) -> None:
        if req.status is RequestStatus.FINISHED:
            return
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
            self._release(req, keep_kv=reason != "error")
        elif req.status is RequestStatus.WAITING and req in self.waiting:
            self.waiting.remove(req)  # retracted while its last token was still on the device
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        self.by_id.pop(req.rid, None)
        self.num_penalized -= req.has_penalties
        self.num_constrained -= req.needs_accepted_tokens

    # ------------------------------------------------------------------ memory
    def _pages_for(self, num_tokens: int) -> int:
        return ceil_div(num_tokens, self.page_size)

    def available_pages(self) -> int:
        """Pages that can be handed out now: free ones and those only the prefix cache holds."""
        return self.alloc.num_free + (self.cache.evictable_pages if self.cache is not None else 0)

    def _alloc(self, n: int) -> List[int]:
        short = n - self.alloc.num_free
        if short > 0 and self.cache is not None and self.cache.evict(short):
            self.tree_changes += 1
        return self.alloc.alloc(n)

    def _release(self, req: Request, keep_kv: bool = True) -> None:
        """Drop a request's pages and row; with the cache on, its computed full pages are kept in the tree first
        (keep_kv False: its KV is not to be trusted, after a failed step)."""
        if self.cache is not None:
            full = min(req.num_cached, len(req.prompt_ids) + len(req.output_ids)) // self.page_size
            if keep_kv and full:
                self._insert(req.all_ids[:full * self.page_size], req.pages[:full])
            if req.cache_node is not None:
                self.cache.unlock(req.cache_node)
                req.cache_node = None
        self.alloc.free(req.pages)
        req.pages = []
        req.num_cached = 0
        if req.row >= 0:
            self.table.free_row(req.row)
            req.row = -1

    def _cache_prefix(self, req: Request) -> None:
        """Put a request's computed full pages in the tree now (so requests admitted later share them while it
        runs), and hold the tree's path to them instead of the one it held."""
        full = req.num_cached // self.page_size
        if not full:
            return
        node = self._insert(req.all_ids[:full * self.page_size], req.pages[:full])
        if node is not req.cache_node:
            self.cache.lock(node)
            if req.cache_node is not None:
                self.cache.unlock(req.cache_node)
            req.cache_node = node

    def _insert(self, token_ids: List[int], pages: List[int]) -> RadixNode:
        """Put pages in the tree, counting it as a change only when the tree adopted new ones."""
        before = self.cache.num_pages
        _, node = self.cache.insert(token_ids, pages)
        self.tree_changes += self.cache.num_pages != before
        return node

    def flush_cache(self) -> bool:
        """Empty the prefix tree (refused, False, while a request holds part of it)."""
        if self.cache is None:
            return True
        if not self.cache.reset():
            return False
        self.tree_changes += 1
        return True

    def _match(self, req: Request) -> Optional[PrefixMatch]:
        """The cached prefix a waiting request can start from (its last token is always computed)."""
        if self.cache is None or req.solo or req.params.prompt_logprobs is not None or \
                (req.embedding is not None and req.embedding.mean):
            return None  # prompt logprobs and mean pooling need every prompt position computed
        m = self.cache.match_prefix(req.all_ids[:req.total_len - 1])
        return m if m.num_tokens else None

    def _reserved_pages(self) -> int:
        toks = sum(min(r.max_new_tokens - r.num_output_tokens, RESERVE_CLIP) for r in self.running)
        return self._pages_for(int(toks * self.new_token_ratio))

    def _place(self, req: Request, n: int) -> torch.Tensor:
        """Give req the pages and table entries for its next n tokens; returns their slots."""
        start = req.num_cached
        extra = self._pages_for(start + n) - len(req.pages)
        if extra > 0:
            req.pages.extend(self._alloc(extra))
        slots = slots_for(req.pages, self.page_size, start, start + n)
        self.table.write(req.row, start, slots)
        return slots

    # ------------------------------------------------------------------ policy
    def schedule(self) -> Optional[ScheduledBatch]:
        """Prefill before decode, except that after a chunk of a prompt being scored the requests that decode take
        a turn (see SCORING_CHUNK)."""
        batch = None
        if self.decode_turn:
            self.decode_turn = False
            batch = self._schedule_decode()
        if batch is None:
            batch = self._schedule_prefill()
            self.decode_turn = batch is not None and any(
                r.params.prompt_logprobs is not None and not sampled for r, sampled in zip(batch.reqs, batch.samples))
        if batch is None:
            batch = self._schedule_decode()
        return batch

    def _waiting_order(self) -> List[Request]:
        """FCFS; with lpm and a long enough queue, longest cached prefix first (FCFS among equals), so requests that
        share a prefix run together while it is in the cache."""
        if self.policy != "lpm" or self.cache is None or len(self.waiting) < LPM_MIN_QUEUE:
            return list(self.waiting)
        hits: Dict[str, Tuple[Request, int, int, int]] = {}
        for r in self.waiting:
            known = self._lpm_hits.get(r.rid)
            if known is None or known[0] is not r or known[1:3] != (self.tree_changes, r.total_len):
                num = self.cache.match_prefix(r.all_ids[:r.total_len - 1]).num_tokens
                known = (r, self.tree_changes, r.total_len, num)
            hits[r.rid] = known
        self._lpm_hits = hits  # requests no longer waiting drop out
        return sorted(self.waiting, key=lambda r: -hits[r.rid][3])

    def _schedule_prefill(self) -> Optional[ScheduledBatch]:
        budget = self.max_prefill_tokens
        reqs: List[Request] = []
        lens: List[int] = []
        matches: Dict[str, PrefixMatch] = {}
        # a request left half-prefilled by chunking goes first
        partial = [r for r in self.running if r.num_cached < r.total_len - 1]
        if not partial and not self.waiting:
            return None
        candidates = partial + self._waiting_order()
        reserved = self._reserved_pages()
        available = self.available_pages()
        chunked = False
        num_new = 0
        heads: Set[Tuple[int, ...]] = set()  # first IN_BATCH_PREFIX tokens of the new requests in this batch
        for req in candidates:
            if req.grammar is not None and not req.grammar.ready:
                continue  # its grammar is still compiling (engine/grammar.py): the others go ahead
            if req.solo and reqs:
                break  # it runs alone
            new = req.status is RequestStatus.WAITING
            if new and len(self.running) + num_new >= self.max_running:
                break
            match = self._match(req) if new else None
            if new and self.cache is not None and req.total_len > IN_BATCH_PREFIX:
                head = tuple(req.prompt_ids[:IN_BATCH_PREFIX])
                if head in heads and (match is None or match.num_tokens < IN_BATCH_PREFIX):
                    continue  # its prefix is being computed in this batch: take it from the cache next step
                heads.add(head)
            start = match.num_tokens if match is not None else req.num_cached
            held = len(match.pages) if match is not None else len(req.pages)
            remaining = req.total_len - start
            chunk = self.chunk if req.params.prompt_logprobs is None else min(self.chunk, SCORING_CHUNK)
            n = min(remaining, chunk, budget)
            if remaining - n == 1 and not req.max_new_tokens:  # its last token would be left to a decode step,
                n = n - 1 if n > 1 else remaining  # which a request that samples nothing never gets
            if n < remaining:
                if chunked:
                    break  # one chunked request at a time
                chunked = True
            need = self._pages_for(start + n) - held
            future = min(req.max_new_tokens - req.num_output_tokens, RESERVE_CLIP) * self.new_token_ratio
            room = available - (held if match is not None else 0)  # a matched prefix stops being evictable
            if need + reserved + (self._pages_for(int(future)) if new else 0) > room:
                if not reqs and not self.running and need <= room:
                    pass  # nothing else can free memory: admit it alone rather than stall
                else:
                    break
            if new and self.table.num_free_rows == 0:
                break
            reqs.append(req)
            lens.append(n)
            if match is not None:
                matches[req.rid] = match
                available -= held
            reserved += need  # claimed by this batch: later candidates must fit in what is left
            if new:
                num_new += 1
                reserved += self._pages_for(int(future))
            budget -= n
            if budget <= 0 or req.solo:
                break
        if not reqs:
            return None
        slots = []
        for req, n in zip(reqs, lens):
            if req.status is RequestStatus.WAITING:
                self.waiting.remove(req)
                req.status = RequestStatus.RUNNING
                req.row = self.table.alloc_row()
                self.running.append(req)
                match = matches.get(req.rid)
                if match is not None:  # start from the cached prefix: share its pages
                    self.alloc.incref(match.pages)
                    self.cache.lock(match.node)
                    req.pages, req.cache_node, req.num_cached = list(match.pages), match.node, match.num_tokens
                    self.table.write(req.row, 0, slots_for(req.pages, self.page_size, 0, match.num_tokens))
                if not req.output_ids:
                    req.num_cached_tokens = req.num_cached  # first admission: the prompt tokens reused
            slots.append(self._place(req, n))
        return ScheduledBatch(ForwardMode.EXTEND, reqs, lens, torch.cat(slots))

    def _schedule_decode(self) -> Optional[ScheduledBatch]:
        # a request whose last allowed token is still on the device needs no further step
        reqs = [r for r in self.running if r.num_cached == r.total_len - 1 and r.num_output_tokens < r.max_new_tokens]
        if not reqs:
            return None
        solo = next((r for r in reqs if r.solo), None)
        if solo is not None:
            reqs = [solo]
        ps = self.page_size
        need = sum(1 for r in reqs if r.num_cached % ps == 0)
        while need > self.available_pages():
            if len(self.running) == 1:  # admission refuses requests larger than the pool, so this cannot happen
                raise RuntimeError("KV pool too small for a single request")
            victim = max(self.running, key=lambda r: r.arrival)
            self._retract(victim)
            if victim in reqs:
                reqs.remove(victim)
            need = sum(1 for r in reqs if r.num_cached % ps == 0)
        if not reqs:
            return None
        self.new_token_ratio = max(MIN_NEW_TOKEN_RATIO, self.new_token_ratio - NEW_TOKEN_RATIO_DECAY)
        fresh = self._alloc(need)  # one new page for each request whose next token starts a page
        slots, rows, positions = [], [], []
        for r in reqs:
            pos = r.num_cached
            if pos % ps == 0:
                r.pages.append(fresh.pop())
            slots.append(r.pages[pos // ps] * ps + pos % ps)
            rows.append(r.row)
            positions.append(pos)
        self.table.write_points(rows, positions, slots)
        n = len(reqs)
        return ScheduledBatch(ForwardMode.DECODE, reqs, [1] * n, host_tensor(slots, torch.int64), [True] * n)

    def _retract(self, req: Request) -> None:
        """Free a running request's KV and queue it again; it will be re-prefilled with its output so far."""
        logger.info("KV pool full: retracting %s (%d tokens) to the waiting queue", req.rid, req.total_len)
        self.running.remove(req)
        self._release(req)
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)
        self.num_retractions += 1
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO

    def commit(self, batch: ScheduledBatch) -> None:
        """The step is queued on the device: its extended tokens count as cached from now on (the device runs
        steps in order, so the next step reads them). An extend step's full pages go into the prefix cache."""
        for r, n in zip(batch.reqs, batch.extend_lens):
            r.num_cached += n
        if self.cache is not None and batch.mode is ForwardMode.EXTEND:
            for r in batch.reqs:
                self._cache_prefix(r)
