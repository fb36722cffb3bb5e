"""Which pages of a sequence's windowed-layer K/V are still read.

A layer with a sliding window of W tokens reads, for a query at position p, the keys p - W + 1 .. p. A sequence
whose next query is at position p (its cached length: every later query, and every query of a chunk that starts
there, reaches back no further) reads no windowed K/V before p - W + 1, so the pages wholly before that are given
back. A cached prefix of L tokens is continued from (its next query at L) only if the windowed pages of its last
window, L - W + 1 .. L - 1, are all still there; else a shorter prefix whose are is used, or none.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import FrozenSet, Optional, Sequence, Tuple

from minisrv.utils import ceil_div


@dataclass(frozen=True)
class WindowRule:
    window: int  # the widest window of the model's windowed layers, in tokens (the query's own included)
    page_size: int

    def first_page(self, pos: int) -> int:
        """The first page a query at position pos, or at any later one, reads."""
        return max(0, pos - self.window + 1) // self.page_size

    def usable_pages(self, window_pages: Sequence[Optional[int]]) -> int:
        """How many leading pages of a cached prefix can be continued from, given its windowed pages (None where
        given back): the most whose last window's pages are all present."""
        n = len(window_pages)
        while n:
            missing = [i for i in range(self.first_page(n * self.page_size), n) if window_pages[i] is None]
            if not missing:
                break
            n = missing[-1]
        return n


def split_pool_pages(tokens: int, num_layers: int, num_window_layers: int, ratio: float, page_size: int,
                     least: int, most: int) -> Tuple[int, int]:
    """(full pages, windowed pages) in the memory a pool of `tokens` in every layer takes: windowed pages `ratio` as
    many as full ones (SGLang's --swa-full-tokens-ratio) but no more than `most` tokens' worth (what every running
    request's window and a step's prefill can hold at once: more would only keep cached windows), never fewer than
    `least` tokens' worth (one request's widest step), nor more than the full ones; the rest of the memory is the
    full layers'."""
    full_layers = num_layers - num_window_layers
    full = max(1, int(tokens * num_layers / (full_layers + ratio * num_window_layers)) // page_size)
    window = min(full, max(min(int(full * ratio), ceil_div(most, page_size)), ceil_div(least, page_size) + 1))
    if full_layers:  # what the windowed pages left of the memory
        full = max(window, (tokens * num_layers - window * page_size * num_window_layers) // (full_layers * page_size))
    return full, window


def windowed_layers(windows: Sequence[Optional[int]], context_length: int,
                    page_size: int) -> Tuple[FrozenSet[int], Optional[WindowRule]]:
    """The layers whose K/V keep only their window (those whose window, None for none, is shorter than the context)
    and the rule of which pages they read (None where there are none)."""
    ids = frozenset(i for i, w in enumerate(windows) if w is not None and w < context_length)
    return ids, WindowRule(max(windows[i] for i in ids), page_size) if ids else None
