"""The queues and the choice of each step: the waiting queue (first come, first served), the running requests,
prefill before decode, the decode set, and retraction (of the newest arrivals) when decode runs out of pages."""
from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from typing import Deque, Dict, List, Optional

import torch

from minisrv.batch import ForwardMode
from minisrv.kvcache import PageAllocator, ReqToTokenTable
from minisrv.kvcache.radix import RadixCache
from minisrv.utils import host_tensor

from ..request import Request, RequestError, RequestStatus
from ..speculative.speculator import Speculator
from .cache import CacheManager
from .prefill import INIT_NEW_TOKEN_RATIO, MIN_NEW_TOKEN_RATIO, NEW_TOKEN_RATIO_DECAY, PrefillAdder
from .window import WindowPages

logger = logging.getLogger(__name__)

# after a step that left a long prompt half-prefilled, the requests that decode take up to this many steps before
# its next chunk: a short request that arrives beside a long prompt is admitted with a chunk and then decodes its
# few tokens in a row, while the long prompt still gets one step in every few
DECODE_STEPS_AFTER_CHUNK = 8
# a chunk sized by time (step_target_s) is never smaller than this (a short prompt that arrives beside a long one
# is not chunked, and so joins the long one's next step: one chunked request a step), and before any extend step
# was timed, never larger than FIRST_TIMED_CHUNK
MIN_TIMED_CHUNK = 128
FIRST_TIMED_CHUNK = 256


@dataclass
class ScheduledBatch:
    """Every request is a sequence of token ids (prompt + output so far), of which the first `num_cached` have K/V
    in the pool. A step extends each of `reqs` by its `extend_lens` tokens; one that reaches the end of its sequence
    samples a token. Prefill, chunked prefill, re-prefill after retraction and decode are all this one operation."""

    mode: ForwardMode
    reqs: List[Request]
    extend_lens: List[int]
    out_cache_loc: torch.Tensor  # [sum(extend_lens)] int64 slots, on the host
    samples: List[bool] = None  # whether each request reaches the end of its sequence (and samples a token)
    # a verify step (engine/speculative/): each request extends by its last token and its draft, and samples at
    # every one of those positions
    drafts: Optional[List[List[int]]] = None

    def __post_init__(self) -> None:
        if self.samples is None and self.drafts is not None:
            self.samples = [True] * len(self.reqs)
        if self.samples is None:
            self.samples = [r.num_cached + n == r.total_len for r, n in zip(self.reqs, self.extend_lens)]


class Scheduler:
    def __init__(self, allocator: PageAllocator, table: ReqToTokenTable, page_size: int, max_running: int,
                 max_prefill_tokens: int, chunked_prefill_size: int, tree: Optional[RadixCache] = None,
                 step_target_s: Optional[float] = None, speculator: Optional[Speculator] = None,
                 windows: Optional[WindowPages] = None) -> None:
        """step_target_s: where steps run to their end one at a time (the CPU), a long prompt's chunks are sized so
        that a step takes about this long, by the speed of the last extend step (`extend_took`): attention over a
        long prefix makes later chunks slower, and the step in progress is what a new request waits for.
        speculator: decode steps of few requests verify drafts (engine/speculative/). windows: the windowed layers'
        own pages, where they keep only their window (window.py)."""
        self.cache = CacheManager(allocator, table, page_size, tree, windows)
        self.max_running = max_running
        self.max_prefill_tokens = max_prefill_tokens
        self.chunk = chunked_prefill_size
        self.waiting: Deque[Request] = deque()
        self.running: List[Request] = []  # resident in the pool, in admission order
        self.by_id: Dict[str, Request] = {}
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO  # see prefill.py
        self.num_retractions = 0
        self.num_penalized = 0  # live requests using penalties (their sampling needs the real previous tokens)
        self.num_constrained = 0  # live requests with a grammar or thinking budget (need the previous token)
        self.decode_turns = 0  # steps that decoding takes before the next chunk of a prompt (see schedule)
        self.step_target_s = step_target_s
        self.extend_tokens_per_s: Optional[float] = None  # the last timed extend step's speed
        self.speculator = speculator

    def add(self, req: Request) -> None:
        if req.rid in self.by_id:
            raise RequestError(f"duplicate request id {req.rid!r}")
        self.waiting.append(req)
        self.by_id[req.rid] = req
        self.num_penalized += req.params.has_penalties
        self.num_constrained += req.needs_accepted_tokens

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def isolate(self, req: Request) -> None:
        """A step with this request failed: recompute it from scratch, in batches of its own, until it samples."""
        req.solo = True
        if req.status is RequestStatus.RUNNING:
            self._requeue(req, keep_kv=False)

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
            self.cache.release(req, keep_kv=reason != "error")
        elif req.status is RequestStatus.WAITING and req in self.waiting:
            self.waiting.remove(req)  # retracted while its last token was still on the device
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        if self.speculator is not None:
            self.speculator.finished(req)
        self.by_id.pop(req.rid, None)
        self.num_penalized -= req.params.has_penalties
        self.num_constrained -= req.needs_accepted_tokens

    def schedule(self) -> Optional[ScheduledBatch]:
        """Prefill before decode, except that after a chunk of a prompt the requests that decode take turns, so that
        no request waits for a whole long prompt's prefill: a few steps (DECODE_STEPS_AFTER_CHUNK) where steps are
        timed to a target (the CPU, whose steps are long), else one step after a chunk of a prompt being scored.
        On a GPU a chunk left by the prefill budget is followed by more prefill at once: decode turns there would
        hold back the admission of a full waiting queue, whose prefills the budget splits nearly every step."""
        batch = None
        if self.cache.windows is not None:  # windowed pages left behind every running request's window go back
            self.cache.windows.trim(self.running)
        if self.decode_turns:
            self.decode_turns -= 1
            batch = self._schedule_decode()
            if batch is None:
                self.decode_turns = 0  # nothing decodes
        if batch is None:
            batch = self._schedule_prefill()
            if batch is not None and self.step_target_s is not None and not all(batch.samples):
                self.decode_turns = DECODE_STEPS_AFTER_CHUNK
            elif batch is not None and any(r.params.prompt_logprobs is not None and not sampled
                                           for r, sampled in zip(batch.reqs, batch.samples)):
                self.decode_turns = 1
        if batch is None:
            batch = self._schedule_decode()
        return batch

    def extend_took(self, num_tokens: int, seconds: float) -> None:
        """An extend step of num_tokens ran to its end in `seconds` (sizes the next chunks, see step_target_s)."""
        if seconds > 0:
            self.extend_tokens_per_s = num_tokens / seconds

    def chunk_size(self) -> int:
        """The most tokens of one prompt the next step computes."""
        if self.step_target_s is None:
            return self.chunk
        if self.extend_tokens_per_s is None:
            return min(self.chunk, FIRST_TIMED_CHUNK)
        return min(self.chunk, max(MIN_TIMED_CHUNK, int(self.extend_tokens_per_s * self.step_target_s)))

    def _schedule_prefill(self) -> Optional[ScheduledBatch]:
        partial = [r for r in self.running if r.num_cached < r.total_len - 1]  # left half-prefilled: they go first
        if not partial and not self.waiting:
            return None
        adder = PrefillAdder(self.cache, self.running, self.max_running, self.max_prefill_tokens, self.chunk_size(),
                             self.new_token_ratio)
        for req in partial + list(self.waiting):
            if not adder.add(req):
                break
        if not adder.admitted:
            return None
        slots = []
        for a in adder.admitted:
            req = a.req
            if req.status is RequestStatus.WAITING:
                self.waiting.remove(req)
                req.status = RequestStatus.RUNNING
                self.running.append(req)
                self.cache.admit(req, a.match)
                if not req.output_ids:
                    req.num_cached_tokens = req.num_cached  # first admission: the prompt tokens reused
            slots.append(self.cache.place(req, a.extend_len))
        return ScheduledBatch(ForwardMode.EXTEND, [a.req for a in adder.admitted],
                              [a.extend_len for a in adder.admitted], torch.cat(slots))

    def _schedule_decode(self) -> Optional[ScheduledBatch]:
        """One token for each running request that has all but its last token computed (a request running alone,
        after a failed step, decodes alone), retracting the newest arrivals while the pool is short of pages. With a
        speculator whose requests draft, a verify step instead (each request's last token and its draft), where the
        pool has the pages for it."""
        cache, running = self.cache, self.running
        # a request whose last allowed token is still on the device needs no further step
        reqs = [r for r in running if r.num_cached == r.total_len - 1 and r.num_output_tokens < r.max_new_tokens]
        solo = next((r for r in reqs if r.solo), None)
        if solo is not None:
            reqs = [solo]
        while reqs and cache.decode_pages(reqs) > cache.available_pages():
            if len(running) == 1:  # admission refuses requests larger than the pool, so this cannot happen
                raise RuntimeError("KV pool too small for a single request")
            victim = max(running, key=lambda r: r.arrival)
            self._retract(victim)
            if victim in reqs:
                reqs.remove(victim)
        if not reqs:
            return None
        self.new_token_ratio = max(MIN_NEW_TOKEN_RATIO, self.new_token_ratio - NEW_TOKEN_RATIO_DECAY)
        drafts = self.speculator.drafts(reqs) if self.speculator is not None else None
        if drafts is not None and cache.verify_pages(reqs, drafts) <= cache.available_pages():
            slots = torch.cat([cache.place(r, 1 + len(d)) for r, d in zip(reqs, drafts)])
            return ScheduledBatch(ForwardMode.EXTEND, reqs, [1 + len(d) for d in drafts], slots, drafts=drafts)
        n = len(reqs)
        return ScheduledBatch(ForwardMode.DECODE, reqs, [1] * n, host_tensor(cache.place_decode(reqs), torch.int64),
                              [True] * n)

    def _retract(self, req: Request) -> None:
        """Free a running request's KV and queue it again; it will be re-prefilled with its output so far."""
        logger.info("KV pool full: retracting %s (%d tokens) to the waiting queue", req.rid, req.total_len)
        self._requeue(req, keep_kv=True)
        self.num_retractions += 1
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO

    def _requeue(self, req: Request, keep_kv: bool) -> None:
        self.running.remove(req)
        self.cache.release(req, keep_kv)
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)

    def commit(self, batch: ScheduledBatch) -> None:
        """The step is queued on the device: its extended tokens count as cached from now on (the device runs
        steps in order, so the next step reads them). An extend step's full pages go into the prefix tree."""
        for r, n in zip(batch.reqs, batch.extend_lens):
            r.num_cached += n
        if batch.mode is ForwardMode.EXTEND and batch.drafts is None:
            for r in batch.reqs:
                self.cache.cache_prefix(r)

    def verified(self, req: Request, num_drafted: int, num_accepted: int) -> None:
        """A verify step's result for a request still running: the positions of its rejected drafts are given
        back (committed as cached, they never held its tokens)."""
        self.cache.rollback(req, num_drafted - num_accepted)
        self.speculator.verified(req, num_drafted, num_accepted)
