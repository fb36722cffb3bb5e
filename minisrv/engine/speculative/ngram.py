"""Drafting by lookup in what was already written: a request that quotes its prompt, rewrites a file or repeats
itself has, somewhere earlier in its own history (or in a recent request's), the tokens it is about to produce.

Each live request has an index from every n-gram of its history (n in [min_match_window, max_match_window]) to
the position just after its most recent occurrence. The index grows only by the tokens appended since the
previous call, so a step costs O(max_match_window) dict work per new token, whatever the history's length. The
history's last n tokens (the suffix being matched) are never indexed as an occurrence of themselves: an entry's
position is always before the end, so a match always has at least one token after it.

Finished requests' histories go to a shared store indexed the same way (as SuffixDecoding and SGLang's n-gram
cache draft across requests), bounded in tokens, oldest histories dropped first. It is consulted for an n only
after the request's own history had no match of that length or longer: the request's own context predicts it
best, and that order keeps the result a pure function of the histories (deterministic).

A match's continuation is what followed it, up to num_draft tokens; where that runs into the end of the history
the draft is shorter. The longest matching n wins even when its continuation is shorter than a shorter n's would
be: a longer match is the stronger evidence, and a short draft costs little to verify.
"""
from __future__ import annotations

from itertools import repeat
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

NGram = Tuple[int, ...]


def _ngrams_ending(tokens: Sequence[int], n: int, start: int, stop: int) -> Iterator[NGram]:
    """The n-grams tokens[e - n:e] for e in range(start, stop) (start >= n), built by zipping n shifted slices so
    that the work is done in C rather than one Python-level slice per position."""
    return zip(*(tokens[start - n + j:stop - n + j] for j in range(n)))


class _RequestIndex:
    """One live request's n-gram index and what of its history it covers: ends e < `length` are indexed."""

    __slots__ = ("ends", "length", "first", "last")

    def __init__(self) -> None:
        self.ends: Dict[NGram, int] = {}
        self.length = 0
        self.first: Optional[int] = None  # tokens[0] and tokens[length - 1] when last indexed: a cheap check
        self.last: Optional[int] = None   # that the next history extends this one

    def extends(self, tokens: Sequence[int]) -> bool:
        return self.length == 0 or (len(tokens) >= self.length and tokens[0] == self.first
                                    and tokens[self.length - 1] == self.last)


class _SharedHistories:
    """Recently finished histories and one index over all of them: n-gram -> (history id, end of its most recent
    occurrence). Ids grow with each history added, so a later history's occurrence replaces an earlier one's.
    Evicting a history deletes the entries that still name it; an entry it had lost to a later history already
    names that one, which is evicted later (oldest first)."""

    def __init__(self, capacity_tokens: int, min_n: int, max_n: int) -> None:
        self.capacity = capacity_tokens
        self.min_n, self.max_n = min_n, max_n
        self.histories: Dict[int, Tuple[int, ...]] = {}  # insertion order is age order
        self.ends: Dict[NGram, Tuple[int, int]] = {}
        self.total_tokens = 0
        self._next_id = 0

    def add(self, tokens: Sequence[int]) -> None:
        history = tuple(tokens[max(0, len(tokens) - self.capacity):])  # a history over capacity keeps its tail
        if len(history) <= self.min_n:  # no n-gram with a token after it
            return
        hid, self._next_id = self._next_id, self._next_id + 1
        self.histories[hid] = history
        self.total_tokens += len(history)
        for n in range(self.min_n, min(self.max_n, len(history) - 1) + 1):
            ends = range(n, len(history))
            self.ends.update(zip(_ngrams_ending(history, n, n, len(history)), zip(repeat(hid), ends)))
        while self.total_tokens > self.capacity:
            self._evict_oldest()

    def _evict_oldest(self) -> None:
        hid = next(iter(self.histories))
        history = self.histories.pop(hid)
        self.total_tokens -= len(history)
        for n in range(self.min_n, min(self.max_n, len(history) - 1) + 1):
            for gram in _ngrams_ending(history, n, n, len(history)):
                entry = self.ends.get(gram)
                if entry is not None and entry[0] == hid:
                    del self.ends[gram]

    def continuation(self, gram: NGram, num_draft: int) -> Optional[List[int]]:
        entry = self.ends.get(gram)
        if entry is None:
            return None
        hid, end = entry
        return list(self.histories[hid][end:end + num_draft])


class NgramProposer:
    """Drafts by lookup: the last n tokens of a request's history (prompt + output), longest n first
    (max_match_window .. min_match_window), matched against earlier places in the same history and then in
    recently finished requests' histories; proposes the tokens that followed the most recent match."""

    def __init__(self, num_draft: int, min_match_window: int = 1, max_match_window: int = 12,
                 shared_capacity_tokens: int = 1 << 20) -> None:
        if num_draft < 1:
            raise ValueError(f"num_draft must be at least 1, got {num_draft}")
        if not 1 <= min_match_window <= max_match_window:
            raise ValueError(f"need 1 <= min_match_window <= max_match_window, got "
                             f"{min_match_window} and {max_match_window}")
        if shared_capacity_tokens < 0:
            raise ValueError(f"shared_capacity_tokens must be >= 0, got {shared_capacity_tokens}")
        self.num_draft = num_draft
        self.min_match_window, self.max_match_window = min_match_window, max_match_window
        self._requests: Dict[str, _RequestIndex] = {}
        self._shared = _SharedHistories(shared_capacity_tokens, min_match_window, max_match_window)

    def propose(self, key: str, tokens: Sequence[int], num_draft: Optional[int] = None) -> List[int]:
        """Up to num_draft (default self.num_draft) tokens to verify after `tokens` (the request's whole history: prompt
        ids + output ids, a list that only ever grows between calls for the same key). [] when nothing matches."""
        k = self.num_draft if num_draft is None else num_draft
        own = self._index(key, tokens)
        if k <= 0:
            return []
        length = len(tokens)
        for n in range(min(self.max_match_window, length), self.min_match_window - 1, -1):
            gram = tuple(tokens[length - n:])
            end = own.ends.get(gram)
            if end is not None:
                return list(tokens[end:end + k])
            shared = self._shared.continuation(gram, k)
            if shared is not None:
                return shared
        return []

    def release(self, key: str, tokens: Sequence[int]) -> None:
        """The request ended: forget its own index; keep its history in the shared store (bounded by
        shared_capacity_tokens, oldest histories dropped first)."""
        self._requests.pop(key, None)
        self._shared.add(tokens)

    def _index(self, key: str, tokens: Sequence[int]) -> _RequestIndex:
        """The key's index brought up to `tokens`: extended by the appended tokens, or rebuilt where `tokens` is not
        an extension of what was indexed (checked by length, first and last indexed token only)."""
        index = self._requests.get(key)
        if index is None or not index.extends(tokens):
            index = self._requests[key] = _RequestIndex()
        start, stop = index.length, len(tokens)
        if stop <= start:
            return index
        # Ends e in [start, stop - 1]: the n-gram ending at the history's end (the suffix) is left out.
        for n in range(self.min_match_window, min(self.max_match_window, stop - 1) + 1):
            first_end = max(start, n)
            index.ends.update(zip(_ngrams_ending(tokens, n, first_end, stop), range(first_end, stop)))
        index.length, index.first, index.last = stop, tokens[0], tokens[stop - 1]
        return index
