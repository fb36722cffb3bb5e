"""How many OpenMP threads a CPU decode step runs on, chosen by timing the steps themselves.

Why: a decode step opens a parallel region per kernel (hundreds a step), each ended by a barrier. On a machine
whose cores other processes also want, a thread of ours is often off its core when a region ends; the others then
wait for it at the barrier, spinning on the core it needs (libgomp spins before it sleeps), and a step takes many
scheduler time slices instead of a few milliseconds. Fewer threads then run far faster, while on a quiet machine
all of them are fastest. Which holds changes as the load does, so the steps are timed: they mostly run on the count
that was fastest and now and then try the others (more and more rarely while those keep losing, again soon when
the current count's time rises). A prompt step runs on the current count, untimed (its length varies).
"""
from __future__ import annotations

import contextlib
import time
from typing import Dict, Iterator, List, Optional, Tuple

import torch

FIRST_INTERVAL = 4  # steps between tries of another count, at first and after a change
LONGEST_INTERVAL = 4096
PROBE_SHARE = 0.01  # a losing try is repeated after enough steps that its extra time is at most this share
WIN = 0.9  # a tried count is taken when its step took less than this share of the current count's
CHANGED = (0.75, 1.5)  # the current count's time moved out of this range of what it was: the load changed
SMOOTHING = 0.25  # weight of a new time in a count's running mean


class ThreadTuner:
    """Picks a thread count for each step (`pick`), learns from its time (`record`); `step` does both around a
    step. Times are kept apart by a key the caller gives (a decode step's sequences)."""

    def __init__(self, most: int) -> None:
        self.counts: List[int] = sorted({most, max(1, most // 2), 1}, reverse=True)
        self.current = self.counts[0]
        self.mean: Dict[Tuple[int, int], float] = {}  # (key, threads) -> seconds
        self.settled: Dict[int, float] = {}  # key -> the current count's mean when the others were last tried
        self.interval = self.countdown = FIRST_INTERVAL
        self.next_try = 0

    def pick(self) -> int:
        if len(self.counts) == 1:
            return self.current
        self.countdown -= 1
        if self.countdown > 0:
            return self.current
        self.countdown = self.interval
        others = [c for c in self.counts if c != self.current]
        self.next_try = (self.next_try + 1) % len(others)
        return others[self.next_try]

    def record(self, key: int, threads: int, seconds: float) -> None:
        known = self.mean.get((key, threads))
        mean = seconds if known is None else known + SMOOTHING * (seconds - known)
        self.mean[(key, threads)] = mean
        if threads == self.current:
            settled = self.settled.setdefault(key, mean)
            if not CHANGED[0] * settled <= mean <= CHANGED[1] * settled:
                self.interval = FIRST_INTERVAL
                self.countdown = min(self.countdown, FIRST_INTERVAL)
                self.settled[key] = mean
            return
        current = self.mean.get((key, self.current))
        if current is None:
            return
        if seconds < WIN * current:
            self.current, self.interval = threads, FIRST_INTERVAL
            self.settled = {key: mean}
        else:  # (under load a try of all the threads can cost a hundred steps)
            extra = int((seconds / current - 1) / PROBE_SHARE)
            self.interval = min(max(2 * self.interval, extra), LONGEST_INTERVAL)
            self.settled[key] = current
        self.countdown = self.interval

    @contextlib.contextmanager
    def step(self, key: Optional[int]) -> Iterator[None]:
        """Runs the block on the chosen count of torch's (and the C kernels') threads; key None: not timed."""
        threads = self.pick() if key is not None else self.current
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        start = time.perf_counter()
        try:
            yield
        finally:
            torch.set_num_threads(before)
        if key is not None:
            self.record(key, threads, time.perf_counter() - start)
