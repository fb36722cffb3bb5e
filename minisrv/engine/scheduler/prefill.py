"""Prefill admission: which requests join the next extend step, and by how many tokens each.

`PrefillAdder.add` is the rule, one candidate at a time: a request joins when its grammar is ready, a running slot
and a table row are free, its chunk fits the step's token budget (one chunked request a step), and the pool holds
its pages plus room for what the running requests and it will still decode (in the windowed layers' own pages too,
where they keep only their window: there a decoding request takes pages only until it holds its window).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Set, Tuple

from minisrv.kvcache.radix import PrefixMatch

from ..request import Request, RequestStatus
from .cache import CacheManager

# SGLang-style estimate of how much of their remaining budget running requests will still decode, used to
# keep room for them when admitting new prefills; it decays as decoding goes well and resets on retraction.
INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY = (INIT_NEW_TOKEN_RATIO - MIN_NEW_TOKEN_RATIO) / 600
RESERVE_CLIP = 4096  # no single request reserves more than this many future tokens
# a waiting request whose first tokens equal those of a request already in the prefill batch being built, and are
# not cached yet, waits one step: the prefix is then in the tree (inserted when that batch is queued) instead of
# being computed twice in one batch
IN_BATCH_PREFIX = 32
# a request that scores its prompt (prompt logprobs) computes logits at every prompt position, which makes its
# prefill dearer than a plain one: it is extended by at most this many tokens a step (and requests that decode
# take their turn between its chunks, as between any long prompt's: scheduler.py)
SCORING_CHUNK = 512


@dataclass
class Admission:
    req: Request
    extend_len: int  # tokens this step computes for it
    match: Optional[PrefixMatch]  # a new request's cached prefix, shared when it is admitted


def decode_budget(req: Request) -> int:
    """Tokens a request may still decode, clipped; times the new-token ratio, what it is expected to."""
    return min(req.max_new_tokens - req.num_output_tokens, RESERVE_CLIP)


class PrefillAdder:
    """One extend step being built: candidates are offered in order (requests left half-prefilled by chunking
    first, then the waiting queue) and each is admitted or passed over by `add`."""

    def __init__(self, cache: CacheManager, running: List[Request], max_running: int, token_budget: int,
                 chunk_size: int, new_token_ratio: float) -> None:
        self.cache = cache
        self.num_running = len(running)
        self.max_running = max_running
        self.budget = token_budget
        self.chunk_size = chunk_size
        self.ratio = new_token_ratio
        # pages kept for what the running requests will still decode, then for what this batch claims
        self.reserved = cache.pages_for(int(sum(decode_budget(r) for r in running) * new_token_ratio))
        self.available = cache.full_pages_available()
        w = cache.windows
        self.window_room = None if w is None else w.available() - sum(
            w.reserve(r, cache.pages_for(int(decode_budget(r) * new_token_ratio))) for r in running)
        self.admitted: List[Admission] = []
        self.num_new = 0
        self.chunked = False  # a request in this batch stops short of its end (one such request a step)
        self.heads: Set[Tuple[int, ...]] = set()  # first IN_BATCH_PREFIX tokens of the new requests in this batch

    def add(self, req: Request) -> bool:
        """Admit req to this step if the rule lets it in; False when no later candidate is to be offered."""
        if req.grammar is not None and not req.grammar.ready:
            return True  # its grammar is still compiling (engine/grammar.py): the others go ahead
        if req.solo and self.admitted:
            return False  # it runs alone
        new = req.status is RequestStatus.WAITING
        if new and self.num_running + self.num_new >= self.max_running:
            return False
        match = self.cache.match(req) if new else None
        if new and self.cache.tree is not None and req.total_len > IN_BATCH_PREFIX:
            head = tuple(req.prompt_ids[:IN_BATCH_PREFIX])
            if head in self.heads and (match is None or match.num_tokens < IN_BATCH_PREFIX):
                return True  # its prefix is being computed in this batch: take it from the cache next step
            self.heads.add(head)
        start = match.num_tokens if match is not None else req.num_cached
        held = len(match.pages) if match is not None else len(req.pages)
        remaining = req.total_len - start
        n = self._extend_len(req, remaining)
        if n < remaining:
            if self.chunked:
                return False
            self.chunked = True
        need = self.cache.pages_for(start + n) - held
        future = self.cache.pages_for(int(decode_budget(req) * self.ratio)) if new else 0
        room = self.available - (held if match is not None else 0)  # a matched prefix stops being evictable
        alone = not self.admitted and not self.num_running and need <= room
        window_claim = 0
        if self.window_room is not None:  # its new windowed pages, those of a match's last window, its decode's
            shared = len(match.pages) - self.cache.windows.rule.first_page(match.num_tokens) if match else 0
            window_claim = need + shared + min(future, self.cache.windows.span)
            alone = alone and need + shared <= self.window_room
            if window_claim > self.window_room and not alone:
                return False
        if need + self.reserved + future > room and not alone:  # alone: nothing else can free memory
            return False
        if new and self.cache.table.num_free_rows == 0:
            return False
        self.admitted.append(Admission(req, n, match))
        if match is not None:
            self.available -= held
        self.reserved += need + future  # claimed by this batch: later candidates must fit in what is left
        if self.window_room is not None:
            self.window_room -= window_claim
        self.num_new += new
        self.budget -= n
        return self.budget > 0 and not req.solo

    def _extend_len(self, req: Request, remaining: int) -> int:
        chunk = self.chunk_size if req.params.prompt_logprobs is None else min(self.chunk_size, SCORING_CHUNK)
        n = min(remaining, chunk, self.budget)
        if remaining - n == 1 and not req.max_new_tokens:  # its last token would be left to a decode step,
            n = n - 1 if n > 1 else remaining  # which a request that samples nothing never gets
        return n
