"""The decode set: running requests whose next step adds one token each, and, when the pool cannot hold their next
tokens, which of them gives its pages back (retraction: it is queued again and re-prefilled later)."""
from __future__ import annotations

from typing import Callable, List, Optional

import torch

from minisrv.batch import ForwardMode
from minisrv.utils import host_tensor

from ..request import Request
from .batch import ScheduledBatch
from ..speculative.speculator import Speculator
from .cache import CacheManager


def decode_batch(running: List[Request], cache: CacheManager, retract: Callable[[Request], None],
                 speculator: Optional[Speculator] = None) -> Optional[ScheduledBatch]:
    """One token for each running request that has all but its last token computed (a request running alone,
    after a failed step, decodes alone), retracting the newest arrivals while the pool is short of pages. With a
    speculator whose requests draft, a verify step instead (each request's last token and its draft), where the
    pool has the pages for it."""
    # a request whose last allowed token is still on the device needs no further step
    reqs = [r for r in running if r.num_cached == r.total_len - 1 and r.num_output_tokens < r.max_new_tokens]
    if not reqs:
        return None
    solo = next((r for r in reqs if r.solo), None)
    if solo is not None:
        reqs = [solo]
    while cache.decode_pages(reqs) > cache.available_pages():
        if len(running) == 1:  # admission refuses requests larger than the pool, so this cannot happen
            raise RuntimeError("KV pool too small for a single request")
        victim = max(running, key=lambda r: r.arrival)
        retract(victim)
        if victim in reqs:
            reqs.remove(victim)
    if not reqs:
        return None
    drafts = speculator.drafts(reqs) if speculator is not None else None
    if drafts is not None and cache.verify_pages(reqs, drafts) <= cache.available_pages():
        slots = torch.cat([cache.place(r, 1 + len(d)) for r, d in zip(reqs, drafts)])
        return ScheduledBatch(ForwardMode.EXTEND, reqs, [1 + len(d) for d in drafts], slots, drafts=drafts)
    slots = cache.place_decode(reqs)
    n = len(reqs)
    return ScheduledBatch(ForwardMode.DECODE, reqs, [1] * n, host_tensor(slots, torch.int64), [True] * n)
