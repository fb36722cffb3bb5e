"""What the scheduler hands the model runner for one step."""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch

from minisrv.batch import ForwardMode

from ..request import Request


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
