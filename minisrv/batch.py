"""A step's value objects, below both the attention backends and the engine: the model worker's view of one step
(ForwardBatch, ForwardMode) and a decode step's cascade plan (PrefixGroups, made by attention/cascade.py's policy).
The scheduler, the model runner and the backends all speak them; none of them needs another's module for it.
"""
from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch


@dataclass(frozen=True)
class PrefixGroups:
    """One decode step's cascade plan, in batch indices (positions in the step's batch).

    `order` lists every batch index once: the members of group 0, then those of group 1, and so on, then every
    request in no group. A group's first member is its leader: the shared level reads the leader's first
    `shared_pages[g]` pages for all its members. The requests in no group (and every request's pages past its
    group's shared ones, which always include the page this step's token is written to) are read per request.
    """

    order: Tuple[int, ...]
    sizes: Tuple[int, ...]  # members of each group, at least MIN_GROUP (or the policy's min_group)
    shared_pages: Tuple[int, ...]  # pages each group shares

    @property
    def num_groups(self) -> int:
        return len(self.sizes)

    @property
    def num_grouped(self) -> int:
        """Requests in some group: the first num_grouped entries of `order`."""
        return sum(self.sizes)

    def leaders(self) -> List[int]:
        """Batch index of each group's leader."""
        return [self.order[end - s] for end, s in zip(itertools.accumulate(self.sizes), self.sizes)]

    def shared_pages_in_order(self) -> List[int]:
        """Shared pages of each entry of `order` (0 for the requests in no group)."""
        out = [n for s, n in zip(self.sizes, self.shared_pages) for _ in range(s)]
        return out + [0] * (len(self.order) - len(out))

    def saved_tokens(self, page_size: int) -> int:
        """Token reads of KV a step saves against reading every request's prefix itself."""
        return sum((s - 1) * n for s, n in zip(self.sizes, self.shared_pages)) * page_size


class ForwardMode(enum.Enum):
    EXTEND = "extend"  # prefill, possibly on top of a cached prefix (chunked prefill, retraction, prefix cache)
    DECODE = "decode"  # exactly one new token per request


@dataclass
class ForwardBatch:
    """The model worker's view of one step: tensors on the device plus the few host-side numbers kernels plan with.

    Token-major tensors have T = sum(extend_lens) rows; request-major ones have B rows.
    """

    mode: ForwardMode
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, absolute position of each token
    out_cache_loc: torch.Tensor  # [T] int64, pool slot each token's k/v is written to
    req_rows: torch.Tensor  # [B] int64, rows of the request->token table
    seq_lens: torch.Tensor  # [B] int32, KV length of each request after this step
    cu_seqlens_q: torch.Tensor  # [B+1] int32, prefix sums of extend_lens
    logit_rows: torch.Tensor  # [L] int64, rows in T whose logits are taken: each request's last token (L = B) or,
    #   in a verify step, every token (L = T)
    seq_lens_cpu: List[int]
    extend_lens_cpu: List[int]
    max_seq_len: int
    # a decode step to run as cascade attention (only ever set for a backend with supports_cascade); it runs eagerly
    prefix_groups: Optional[PrefixGroups] = None
    verify: bool = False  # an extend step that verifies drafts (engine/speculative/): logits at every token

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def is_decode(self) -> bool:
        return self.mode is ForwardMode.DECODE

    @property
    def prefix_lens_cpu(self) -> List[int]:
        return [s - e for s, e in zip(self.seq_lens_cpu, self.extend_lens_cpu)]
