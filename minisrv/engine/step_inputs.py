"""A step's inputs as plain host data, and the layout of their one int64 buffer.

`StepInputs` is everything a forward step needs, built from the scheduled batch: what rank 0 sends the other
tensor-parallel ranks so that every rank runs the same step without knowing any request. Its integer fields travel
in one host buffer, laid out by `StepLayout`, so that one host-to-device copy moves them all; on the device the
buffer is viewed field by field (`StepTensors`), never copied again. Each field starts 16 bytes into the buffer (an
odd-length field is followed by one unused word): Triton compiles a kernel once per alignment of its pointer
arguments, so views at odd offsets would compile another copy of each kernel they reach, mid-serving, the first
time a step's token count is odd.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from typing import List, Optional, Sequence

import torch

from minisrv.batch import ForwardMode, PrefixGroups
from minisrv.utils import host_tensor

# the buffer's fields, in order; seq_lens and cu_seqlens_q are next to each other so that one conversion makes both
# int32 on the device, and out_cache_loc comes last since it is already a host tensor (the scheduler's slots)
FIELDS = ("input_ids", "positions", "req_rows", "logit_rows", "seq_lens", "cu_seqlens_q", "pending_rows",
          "out_cache_loc")


@dataclass
class StepTensors:
    """A step's integer fields on the device, views of the one buffer copied there."""

    input_ids: torch.Tensor  # [T] int64 (a pending decode input still 0: read from the previous step's ids)
    positions: torch.Tensor  # [T] int64
    req_rows: torch.Tensor  # [B] int64, rows of the request->token table
    logit_rows: torch.Tensor  # [L] int64, rows in T whose logits are taken (each request's last, or all)
    seq_lens: torch.Tensor  # [B] int32, KV length of each request after the step
    cu_seqlens_q: torch.Tensor  # [B+1] int32, prefix sums of extend_lens
    pending_rows: torch.Tensor  # [P] int64, per decode input: its row in the previous step's sampled ids, or -1
    out_cache_loc: torch.Tensor  # [T] int64, pool slot each token's k/v is written to


@dataclass(frozen=True)
class StepLayout:
    """How long each field of FIELDS is in a step of `num_tokens` tokens (T), `batch_size` requests (B),
    `num_pending` pending decode inputs (P: 0 unless some input is still on the device) and `num_logit_rows` rows
    whose logits are taken (L: B, or T in a verify step)."""

    num_tokens: int
    batch_size: int
    num_pending: int
    num_logit_rows: int

    def sizes(self) -> List[int]:
        t, b, p = self.num_tokens, self.batch_size, self.num_pending
        return [t, t, b, self.num_logit_rows, b, b + 1, p, t]

    def spans(self) -> List[int]:
        """Each field's words in the buffer: its length, rounded up to even (whole 16 bytes) but for the last."""
        sizes = self.sizes()
        return [n + (n & 1) for n in sizes[:-1]] + sizes[-1:]

    def pack(self, pin: bool, out_cache_loc: torch.Tensor, **fields: Sequence[int]) -> torch.Tensor:
        """The host buffer: every field of FIELDS but out_cache_loc given by name as a list, then out_cache_loc
        (pinned memory when `pin`, so that its copy to the device does not wait)."""
        head = host_tensor(list(chain.from_iterable(
            chain(fields[name], (0,) * (len(fields[name]) & 1)) for name in FIELDS[:-1])), torch.int64)
        buf = torch.empty(head.numel() + out_cache_loc.numel(), dtype=torch.int64, pin_memory=pin)
        torch.cat([head, out_cache_loc], out=buf)
        assert buf.numel() == sum(self.spans()), "a field's length does not match the step's layout"
        return buf

    def unpack(self, buf: torch.Tensor) -> StepTensors:
        """The fields of a buffer on the device, as views (seq_lens and cu_seqlens_q converted to int32 together)."""
        spans = self.spans()
        views = {name: v[:n] for name, v, n in zip(FIELDS, buf.split(spans), self.sizes())}
        at = sum(spans[:FIELDS.index("seq_lens")])
        b, b_span = self.batch_size, spans[FIELDS.index("seq_lens")]
        both = buf[at:at + b_span + b + 1].to(torch.int32)
        views["seq_lens"], views["cu_seqlens_q"] = both[:b], both[b_span:]
        return StepTensors(**views)


@dataclass
class StepInputs:
    mode: ForwardMode
    ints: torch.Tensor  # the step's integer fields in one int64 host buffer, laid out by `layout`
    layout: StepLayout
    seq_lens: List[int]
    extend_lens: List[int]
    sample_rows: Optional[List[int]]  # rows of the batch that sample a token (None: all)
    score_rows: Optional[List[int]] = None  # prompt logprobs: token rows whose next token is scored ...
    score_targets: Optional[List[int]] = None  # ... and those next tokens
    score_top_n: int = 0
    table_writes: Optional[list] = None  # request->token table writes since the last step (tensor parallel)
    prefix_groups: Optional[PrefixGroups] = None  # a decode step to run as cascade attention (attention/cascade.py)
    verify: bool = False  # a verify step (engine/speculative/): logits and a sample at every token

    @property
    def num_sampled(self) -> int:
        if self.verify:
            return self.layout.num_tokens
        return len(self.seq_lens) if self.sample_rows is None else len(self.sample_rows)
