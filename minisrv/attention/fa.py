"""FlashAttention-3 over the paged pool (Hopper), through `flash_attn_with_kvcache`.

The kernel reads K/V straight from the pool: `k_cache`/`v_cache` are one layer's [num_pages, page_size, Hkv, D]
tensors, `page_table` [B, max_pages] lists each request's pages in order and `cache_seqlens` [B] how many of
their tokens are valid. New tokens' k/v are written into the pool first (`pool.store`), so the kernel only ever
reads; extend batches pass ragged queries through `cu_seqlens_q` with `causal=True`, which FA3 aligns to the
bottom right (query j of a request with prefix p sees keys 0..p+j), exactly the cached-prefix causal mask.

The kernel comes from sgl-kernel (`sgl_kernel.flash_attn`) when installed, else from upstream FlashAttention-3's
`flash_attn_interface`; both take the same keyword arguments (sgl-kernel adds `ver`, pinned to 3 here).
"""
from __future__ import annotations

import functools
import inspect
from typing import Callable, Optional

import torch

from .base import AttentionBackend, ForwardBatch, ceil_div


def _load_kernel() -> Callable:
    errors = []
    try:
        from sgl_kernel.flash_attn import flash_attn_with_kvcache as fn
    except (ImportError, OSError) as e:  # absent, or present but its extension does not load here
        errors.append(f"sgl_kernel.flash_attn: {e}")
    else:
        try:
            takes_ver = "ver" in inspect.signature(fn).parameters
        except (TypeError, ValueError):
            takes_ver = False
        return functools.partial(fn, ver=3) if takes_ver else fn
    try:
        from flash_attn_interface import flash_attn_with_kvcache as fn
    except (ImportError, OSError) as e:
        errors.append(f"flash_attn_interface: {e}")
    else:
        return fn
    raise ImportError("the fa backend needs FlashAttention-3: pip install sgl-kernel (or upstream "
                      "flash_attn_interface); " + "; ".join(errors))


class FlashAttentionBackend(AttentionBackend):
    name = "fa"
    supports_cuda_graph = True

    def __init__(self, pool, req_to_token: torch.Tensor, num_q_heads: int, **kw) -> None:
        super().__init__(pool, req_to_token, num_q_heads)
        self._attn = _load_kernel()
        self.page_size = pool.page_size
        # per-step metadata, built by prepare / prepare_for_capture / prepare_for_replay
        self.loc: Optional[torch.Tensor] = None
        self.decode = False
        self.page_table: Optional[torch.Tensor] = None
        self.cache_seqlens: Optional[torch.Tensor] = None
        self.cu_seqlens_q: Optional[torch.Tensor] = None
        self.max_seqlen_q = 1
        # CUDA-graph state
        self.g_page_table: Optional[torch.Tensor] = None
        self.g_cache_seqlens: Optional[torch.Tensor] = None

    # -- metadata -------------------------------------------------------------------------------------------

    def _page_table(self, rows: torch.Tensor, max_seq_len: int) -> torch.Tensor:
        """[B, ceil(max_seq_len / page_size)] int32 page ids: slots at positions k*page_size are page starts."""
        ps = self.page_size
        if ps == 1:
            return self.req_to_token[rows, :max_seq_len]
        return self.req_to_token[rows, :max_seq_len:ps] // ps

    def prepare(self, b: ForwardBatch) -> None:
        self.loc = b.out_cache_loc
        self.decode = b.is_decode
        self.page_table = self._page_table(b.req_rows, b.max_seq_len)
        self.cache_seqlens = b.seq_lens if b.seq_lens.dtype == torch.int32 else b.seq_lens.to(torch.int32)
        if self.decode:
            self.cu_seqlens_q = None
            self.max_seqlen_q = 1
        else:
            self.cu_seqlens_q = b.cu_seqlens_q if b.cu_seqlens_q.dtype == torch.int32 \
                else b.cu_seqlens_q.to(torch.int32)
            self.max_seqlen_q = max(b.extend_lens_cpu)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int) -> torch.Tensor:
        self.pool.store(layer_id, self.loc, k, v)
        k_cache, v_cache = self.pool.k[layer_id], self.pool.v[layer_id]
        if self.decode:
            o = self._attn(q=q.unsqueeze(1), k_cache=k_cache, v_cache=v_cache,
                           cache_seqlens=self.cache_seqlens, page_table=self.page_table,
                           softmax_scale=self.scale, causal=True)
            return o.squeeze(1)
        return self._attn(q=q, k_cache=k_cache, v_cache=v_cache,
                          cache_seqlens=self.cache_seqlens, page_table=self.page_table,
                          cu_seqlens_q=self.cu_seqlens_q, max_seqlen_q=self.max_seqlen_q,
                          softmax_scale=self.scale, causal=True)

    # -- CUDA graphs (decode) -------------------------------------------------------------------------------

    def init_graph_state(self, max_bs: int, max_seq_len: int) -> None:
        dev = self.req_to_token.device
        self.g_max_pages = ceil_div(max_seq_len, self.page_size)
        self.g_page_table = torch.zeros((max_bs, self.g_max_pages), dtype=torch.int32, device=dev)
        self.g_cache_seqlens = torch.ones((max_bs,), dtype=torch.int32, device=dev)

    def _fill_static(self, b: ForwardBatch, padded_bs: int) -> None:
        if self.g_page_table is None:
            raise RuntimeError("init_graph_state must be called before capture/replay")
        bs = b.batch_size
        if padded_bs < bs or padded_bs > self.g_page_table.shape[0]:
            raise ValueError(f"padded batch size {padded_bs} outside [{bs}, {self.g_page_table.shape[0]}]")
        ncols = ceil_div(b.max_seq_len, self.page_size)
        if ncols > self.g_max_pages:
            raise ValueError(f"sequence length {b.max_seq_len} exceeds the graph's max_seq_len")
        self.g_page_table[:bs, :ncols].copy_(self._page_table(b.req_rows[:bs], b.max_seq_len))
        self.g_cache_seqlens[:bs].copy_(b.seq_lens[:bs])
        if padded_bs > bs:  # padding rows attend to one valid token of page 0
            self.g_page_table[bs:padded_bs, 0] = 0
            self.g_cache_seqlens[bs:padded_bs] = 1
        self.decode = True
        self.cu_seqlens_q = None
        self.max_seqlen_q = 1
        # full-width slices: the kernel's shapes (and so its launch decisions) depend only on padded_bs
        self.page_table = self.g_page_table[:padded_bs]
        self.cache_seqlens = self.g_cache_seqlens[:padded_bs]

    def prepare_for_capture(self, b: ForwardBatch) -> None:
        if not b.is_decode:
            raise ValueError("CUDA graphs capture decode batches only")
        self._fill_static(b, b.batch_size)
        self.loc = b.out_cache_loc

    def prepare_for_replay(self, b: ForwardBatch, padded_bs: int) -> None:
        self._fill_static(b, padded_bs)
        self.loc = b.out_cache_loc
