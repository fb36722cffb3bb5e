"""A batch's pages as a page table, the form FA3 (`fa.py`), XQA (`xqa.py`) and the triton decode take: [B, max_pages]
int32 page ids, a row per request, with the lengths [B] int32 beside it; its CUDA-graph form, static buffers rewritten
in place before each replay; and the decode hooks of the backends that read it (PageTableGraphs)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Tuple

import torch

from minisrv.utils import ceil_div

from minisrv.batch import ForwardBatch


def page_table(req_to_token: torch.Tensor, rows: torch.Tensor, max_seq_len: int, page_size: int) -> torch.Tensor:
    """[B, ceil(max_seq_len / page_size)] int32 page ids: a page's first slot is its id times page_size."""
    if page_size == 1:
        return req_to_token[rows, :max_seq_len]
    return req_to_token[rows, :max_seq_len:page_size] // page_size


def window_slots(window_table: torch.Tensor, b: ForwardBatch, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The slots of a step's tokens in the windowed layers' own pages (kvcache/pool.py): the window table at each
    token's row and position, as int64, or written into `out` (a CUDA graph's fixed buffer, gathered again before each
    replay from the graph's inputs, whose padding rows sit at the pad row's first slot)."""
    rows = b.req_rows
    if not b.is_decode:
        ext = b.cu_seqlens_q[1:] - b.cu_seqlens_q[:-1]
        rows = torch.repeat_interleave(rows, ext, output_size=b.num_tokens)
    loc = window_table[rows, b.positions]
    return loc.long() if out is None else out.copy_(loc)


class StaticPageTable:
    """A page table and lengths at fixed addresses for captured decode graphs: full width (max_seq_len's pages), so
    a kernel's shapes, and the launch decisions it makes from them, depend only on the graph's batch size."""

    def __init__(self, max_bs: int, max_seq_len: int, page_size: int, device: torch.device) -> None:
        self.page_size = page_size
        self.table = torch.zeros((max_bs, ceil_div(max_seq_len, page_size)), dtype=torch.int32, device=device)
        self.seq_lens = torch.ones((max_bs,), dtype=torch.int32, device=device)

    def rows(self, bs: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """The views a graph of `bs` rows captures: (page table [bs, max_pages], lengths [bs])."""
        return self.table[:bs], self.seq_lens[:bs]

    def fill(self, req_to_token: torch.Tensor, b: ForwardBatch, padded_bs: int) -> None:
        """Write batch b into the leading rows; rows bs..padded_bs (graph padding) attend to one token of page 0,
        a valid page whose result is dropped."""
        bs = b.batch_size
        if padded_bs < bs or padded_bs > self.table.shape[0]:
            raise ValueError(f"padded batch size {padded_bs} outside [{bs}, {self.table.shape[0]}]")
        ncols = ceil_div(b.max_seq_len, self.page_size)
        if ncols > self.table.shape[1]:
            raise ValueError(f"sequence length {b.max_seq_len} exceeds the graph's max_seq_len")
        self.table[:bs, :ncols].copy_(page_table(req_to_token, b.req_rows[:bs], b.max_seq_len, self.page_size))
        self.seq_lens[:bs].copy_(b.seq_lens[:bs])
        if padded_bs > bs:
            self.table[bs:padded_bs, 0] = 0
            self.seq_lens[bs:padded_bs] = 1


def require(static: Optional[StaticPageTable]) -> StaticPageTable:
    if static is None:
        raise RuntimeError("init_graph_state must be called before capture/replay")
    return static


@dataclass(frozen=True)
class DecodePages:
    """A decode step's metadata where the kernel takes only the page table and lengths (triton_decode.py, xqa.py)."""

    loc: torch.Tensor  # [B] slots the step's k/v go to
    page_table: torch.Tensor  # [B, max_pages] int32
    seq_lens: torch.Tensor  # [B] int32, counting the step's own token


class PageTableGraphs:
    """The decode hooks of a backend that reads a page table and lengths (fa, xqa, triton): an eager step's metadata
    from the batch's own page table, and CUDA graphs over the StaticPageTable's rows, which every replay rewrites
    first. A backend mixes this in before AttentionBackend, has `page_size` and `req_to_token`, and says how its step
    metadata is made from (slots, page table, lengths) where that is more than DecodePages: `decode_meta`. A decode
    backend (xqa, triton) runs its kernel in `attend`, after `forward` has stored the step's k/v."""

    static: Optional[StaticPageTable] = None

    def decode_meta(self, loc: torch.Tensor, table: torch.Tensor, seq_lens: torch.Tensor) -> Any:
        return DecodePages(loc, table, seq_lens)

    def kv_store_target(self, layer_id: int, meta: Any) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
        return self._pool_target(layer_id, meta.loc)

    def forward(self, q: torch.Tensor, k: Optional[torch.Tensor], v: Optional[torch.Tensor], layer_id: int,
                meta: Any) -> torch.Tensor:
        if k is not None:
            self.pool.store(layer_id, meta.loc, k, v)
        return self.attend(q, layer_id, meta)

    def prepare(self, b: ForwardBatch) -> Any:
        """An eager decode step's metadata (a backend that also runs other steps has a prepare of its own); raises
        for any other step (`name` says whose)."""
        if not b.is_decode:
            raise ValueError(f"the {self.name} backend runs decode steps only")
        return self.decode_meta(b.out_cache_loc, page_table(self.req_to_token, b.req_rows, b.max_seq_len,
                                                            self.page_size), b.seq_lens.to(torch.int32))

    def init_graph_state(self, max_bs: int, max_seq_len: int) -> None:
        self.static = StaticPageTable(max_bs, max_seq_len, self.page_size, self.device)

    def prepare_for_capture(self, b: ForwardBatch) -> Any:
        if not b.is_decode:
            raise ValueError("CUDA graphs capture decode batches only")
        static = require(self.static)
        static.fill(self.req_to_token, b, b.batch_size)
        return self.decode_meta(b.out_cache_loc, *static.rows(b.batch_size))

    def prepare_for_replay(self, b: ForwardBatch, padded_bs: int, meta: Any) -> None:
        require(self.static).fill(self.req_to_token, b, padded_bs)
