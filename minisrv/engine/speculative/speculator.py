"""Which requests draft this step, how many tokens, and what came of it.

A verify step scores each drafting request's last token and its drafts in one forward (an extend step of 1 + k
tokens) and keeps the longest run of drafts the target itself samples, plus the target's next token (verify.py).
Drafting pays where a step's cost is the weights' read, not the batch's compute: small batches. So speculation is
off while more than `disable_by_batch_size` requests run, and a request whose drafts keep missing (or who finds
nothing to propose) backs off for a few steps, doubling each time, so that a request that does not repeat itself
costs almost nothing. Requests whose next token depends on the previous one being accepted on the host first (a
grammar's mask, a thinking budget) never draft.

The proposer is any object with `propose(key, tokens, num_draft) -> list` and `release(key, tokens)` (ngram.py's
NgramProposer, eagle.py's EagleProposer; a benchmark may put its own in its place). `propose` may return None: it
needs the target's state at the request's last token first (EAGLE-3), so the request is verified without drafts.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Protocol, Sequence

from minisrv.config import EngineConfig

from ..request import Request
from .ngram import NgramProposer

# the largest decode batch that still drafts, by device, where --speculative-disable-by-batch-size is not given:
# where drafts replayed at 70% acceptance still gained on the three GPU shapes and on the default model on the CPU
# (docs/benchmarks.md, "Speculative decoding")
DEFAULT_DISABLE_BY_BATCH_SIZE = {"cuda": 8, "cpu": 4}
MAX_BACKOFF_STEPS = 64  # a request whose drafts keep missing tries again after at most this many steps


class Proposer(Protocol):
    def propose(self, key: str, tokens: Sequence[int], num_draft: int) -> Optional[List[int]]: ...

    def release(self, key: str, tokens: Sequence[int]) -> None: ...


@dataclass
class SpeculationStats:
    """Counted since the start; Engine.stats reports each as spec_<field>."""

    verify_steps: int = 0
    verified_requests: int = 0  # requests verified, summed over the steps
    draft_tokens: int = 0
    accepted_tokens: int = 0


@dataclass
class _Drafting:
    """A request the proposer has looked up (its history goes to the proposer's store when it ends)."""

    length: int  # its next draft's length, at most
    misses: int = 0  # drafts in a row that gained nothing
    resume_at: int = 0  # the speculator's step count from which it drafts again


class Speculator:
    def __init__(self, proposer: Proposer, num_draft_tokens: int, disable_by_batch_size: int,
                 adaptive_length: bool = False) -> None:
        """num_draft_tokens: positions a verify step scores per request (its last token and the drafts).
        adaptive_length: a request's next draft is as long as its last draft's kept run plus one (up to the most),
        where a verify step's cost grows with its tokens (the CPU, whose projections are compute-bound)."""
        self.proposer = proposer
        self.max_drafts = num_draft_tokens - 1
        self.disable_by_batch_size = disable_by_batch_size
        self.stats = SpeculationStats()
        self.adaptive_length = adaptive_length
        self._steps = 0
        self._requests: Dict[str, _Drafting] = {}

    def _may_draft(self, req: Request) -> bool:
        d = self._requests.get(req.rid)
        return not req.needs_accepted_tokens and (d is None or d.resume_at <= self._steps)

    def wants_drafts(self, running: List[Request]) -> bool:
        """Whether the next decode step may draft (the engine then brings every token in flight to the host
        first: drafts are made from them)."""
        return len(running) <= self.disable_by_batch_size and any(self._may_draft(r) for r in running)

    def drafts(self, reqs: List[Request]) -> Optional[List[List[int]]]:
        """Each decoding request's draft ([] for one that does not draft this step), or None: none drafts. A
        request whose newest token is still on the device (wants_drafts said no, so the engine left it there)
        never drafts: its history is not known yet, and a verify step takes every input from the host, so then none
        does. A step is counted after the choice, so that wants_drafts before the step and this choice agree."""
        if len(reqs) > self.disable_by_batch_size:
            return None
        if any(r.num_pending for r in reqs):
            self._steps += 1
            return None
        out: List[List[int]] = []
        refresh = False  # a request is verified without drafts for its proposer to see the target's state
        for r in reqs:
            d = self._requests.get(r.rid)
            room = min(d.length if d is not None else self.max_drafts, r.max_new_tokens - r.num_output_tokens - 1)
            draft: List[int] = []
            if room > 0 and self._may_draft(r):
                d = self._requests.setdefault(r.rid, _Drafting(self.max_drafts))
                proposed = self.proposer.propose(r.rid, r.all_ids, room)
                refresh |= proposed is None
                draft = list(proposed[:room]) if proposed is not None else []
                if proposed is not None and not draft:
                    self._missed(d)  # nothing to propose: look again in a while
            out.append(draft)
        self._steps += 1
        return out if any(out) or refresh else None

    def verified(self, req: Request, num_drafted: int, num_accepted: int) -> None:
        s = self.stats
        s.verified_requests += 1
        s.draft_tokens += num_drafted
        s.accepted_tokens += num_accepted
        if num_drafted:  # (it was looked up: it drafted)
            d = self._requests[req.rid]
            if self.adaptive_length:
                d.length = min(self.max_drafts, num_accepted + 1)
            if num_accepted:  # the back-off ends
                d.misses = d.resume_at = 0
            else:
                self._missed(d)

    def finished(self, req: Request) -> None:
        """A request ended. Its history goes to the proposer's store only if it was ever looked up: a request that
        only ran in large batches (no drafting) costs the engine loop nothing at its end."""
        if self._requests.pop(req.rid, None) is not None:
            self.proposer.release(req.rid, req.all_ids)

    def _missed(self, d: _Drafting) -> None:
        d.misses += 1
        d.resume_at = self._steps + min(1 << (d.misses - 1), MAX_BACKOFF_STEPS)


def speculation_batch_limit(cfg: EngineConfig, device_type: str) -> int:
    """The largest decode batch that drafts (0: speculation off)."""
    if cfg.speculative_algorithm is None:
        return 0
    limit = cfg.speculative_disable_by_batch_size
    return DEFAULT_DISABLE_BY_BATCH_SIZE.get(device_type, DEFAULT_DISABLE_BY_BATCH_SIZE["cuda"]) \
        if limit is None else limit


def make_speculator(cfg: EngineConfig, device_type: str, proposer: Optional[Proposer] = None) -> Optional[Speculator]:
    """The engine's speculator from its settings (None: speculation off). proposer: EAGLE3's, built by the engine
    (it holds the draft head); NGRAM's is built here."""
    if cfg.speculative_algorithm is None:
        return None
    if proposer is None:
        proposer = NgramProposer(cfg.speculative_num_draft_tokens - 1, cfg.speculative_ngram_min_match_window_size,
                                 cfg.speculative_ngram_max_match_window_size)
    return Speculator(proposer, cfg.speculative_num_draft_tokens, speculation_batch_limit(cfg, device_type),
                      adaptive_length=device_type == "cpu")
