"""FlashAttention-3 over the paged pool (Hopper), through `flash_attn_with_kvcache`.

The kernel reads K/V straight from the pool through a page table (page_table.py); new tokens' k/v are stored first.
Extend batches pass ragged queries through `cu_seqlens_q` with `causal=True`, which FA3 aligns to the bottom right
(query j of a request with prefix p sees keys 0..p+j), exactly the cached-prefix causal mask. A layer's sliding
window, scale and learned sinks (attention_options.py) are the call's `window_size`, `softmax_scale` and `sinks`
(bfloat16 [Hq], the one dtype FA3 takes them in: builds made for gpt-oss take them; one without the argument is
refused for such a model); soft-capped models go to fi (the registry's features: FA3 builds may leave soft-capping
out).

Where the pool's windowed layers keep only their window (kvcache/pool.py), those layers read a second page table,
made from the window table the same way, and store the step's K/V at their own slots (page_table.window_slots). Its
columns before a request's window hold stale but valid page ids, which FA3's window skips (or masks, in a block
that straddles the window's start). CUDA graphs keep that table and those slots in fixed buffers of their own,
rewritten before each replay; verify steps of speculative decoding then run eagerly.

With an FP8 pool the kernel runs in its FP8 mode, which takes q, K and V all in float8_e4m3fn (it has no mode with
a bf16 query over an FP8 cache): q is cast to e4m3 (saturated, no scale: queries normally sit far inside +-448),
the pool's per-layer K and V scales go in as `k_descale` / `v_descale` ([B, Hkv], expanded from one element, so no
copy), and the output comes back in bf16. The kernel also rounds the softmax probabilities to e4m3 for the P @ V
product, so this path is a little less exact than FlashInfer's, which keeps q in the model's dtype.

The kernel comes from sgl-kernel (`sgl_kernel.flash_attn`) when installed, else from upstream FlashAttention-3's
`flash_attn_interface`; both take the same keyword arguments (sgl-kernel adds `ver`, pinned to 3 here).
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import types
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Tuple

import torch

from minisrv.batch import ForwardBatch

from .base import AttentionBackend
from .page_table import PageTableGraphs, StaticPageTable, page_table, require, window_slots


def load_kernel() -> Callable:
    errors = []
    try:
        from sgl_kernel.flash_attn import flash_attn_with_kvcache as fn
    except (ImportError, OSError) as e:  # absent, or present but its extension does not load here
        errors.append(f"sgl_kernel.flash_attn: {e}")
    else:
        return functools.partial(fn, ver=3) if _takes(fn, "ver") else fn
    try:
        from flash_attn_interface import flash_attn_with_kvcache as fn
    except (ImportError, OSError) as e:
        errors.append(f"flash_attn_interface: {e}")
    else:
        return without_custom_op(fn, "_flash_attn_forward")
    raise ImportError("the fa backend needs FlashAttention-3: pip install sgl-kernel (or upstream "
                      "flash_attn_interface); " + "; ".join(errors))


def _takes(fn: Callable, argument: str) -> bool:
    try:
        return argument in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def without_custom_op(fn: Callable, op_name: str) -> Callable:
    """A copy of `fn` that calls the Python body of the torch.library custom op its module names `op_name` instead
    of the op. Upstream flash_attn_interface wraps its forward in such an op (for torch.compile): the op's first
    call imports torch's compiler stack (torch._dynamo, sympy) inside the first prefill and every call goes through
    the dispatcher. The body calls the same kernel; the module itself is left as it is."""
    body = getattr(fn.__globals__.get(op_name), "_init_fn", None)
    if body is None:
        return fn
    copy = types.FunctionType(fn.__code__, {**fn.__globals__, op_name: body}, fn.__name__, fn.__defaults__,
                              fn.__closure__)
    copy.__kwdefaults__ = fn.__kwdefaults__
    return copy


@dataclass(frozen=True)
class FAMeta:
    loc: torch.Tensor  # [T] slots the step's k/v go to
    page_table: torch.Tensor  # [B, max_pages] int32
    cache_seqlens: torch.Tensor  # [B] int32
    cu_seqlens_q: Optional[torch.Tensor]  # [B+1] int32 for extend; None: every request has max_seqlen_q queries
    max_seqlen_q: int  # (decode: 1; a verify step in a CUDA graph: its query length)
    # where the pool's windowed layers keep only their window: their slots of the step's tokens [T] and their page
    # table [B, max_pages] int32 (None: one table for every layer)
    window_loc: Optional[torch.Tensor] = None
    window_table: Optional[torch.Tensor] = None


class FlashAttentionBackend(PageTableGraphs, AttentionBackend):
    name = "fa"
    supports_cuda_graph = True

    def __init__(self, pool, req_to_token: torch.Tensor, num_q_heads: int, layers=None,
                 window_table: Optional[torch.Tensor] = None) -> None:
        super().__init__(pool, req_to_token, num_q_heads, layers)
        self.window_table = window_table if pool.window_layers else None
        self.static_window: Optional[StaticPageTable] = None
        self._attn = load_kernel()
        if any(a.sinks is not None for a in self.layers) and not _takes(self._attn, "sinks"):
            raise ValueError("this FlashAttention-3 build takes no attention sinks, which this model has: use "
                             "--attention-backend torch, or a build made for gpt-oss (sgl-kernel)")
        # each layer's options as the kernel's keyword arguments (the defaults where a layer has none; FA3 takes the
        # sinks in bfloat16 whatever the model's dtype, as gpt-oss's checkpoints hold them)
        self.layer_args = [dict(softmax_scale=a.scale, **({"window_size": (a.window_left, 0)} if a.window else {}),
                                **({"sinks": a.sinks_tensor(pool.device).bfloat16()} if a.sinks is not None else {}))
                           for a in self.layers]
        self.fp8 = pool.quantized
        if self.fp8 and self.head_dim % 16:
            raise ValueError(f"the fa backend's FP8 mode needs head_dim to be a multiple of 16; this model's is "
                             f"{self.head_dim}: use --kv-cache-dtype auto, or another attention backend")

    def prepare(self, b: ForwardBatch) -> FAMeta:
        seqlens = b.seq_lens.to(torch.int32)  # (no copy where it is int32 already)
        table = page_table(self.req_to_token, b.req_rows, b.max_seq_len, self.page_size)
        window = {} if self.window_table is None else dict(
            window_loc=window_slots(self.window_table, b),
            window_table=page_table(self.window_table, b.req_rows, b.max_seq_len, self.page_size))
        queries = (None, 1) if b.is_decode else (b.cu_seqlens_q.to(torch.int32), max(b.extend_lens_cpu))
        return FAMeta(b.out_cache_loc, table, seqlens, *queries, **window)

    def _reads(self, layer_id: int, meta: FAMeta) -> Tuple[torch.Tensor, torch.Tensor]:
        """(slots the step's K/V go to, page table) of the layer's kind of pages."""
        if meta.window_table is not None and layer_id in self.pool.window_layers:
            return meta.window_loc, meta.window_table
        return meta.loc, meta.page_table

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, meta: FAMeta) -> torch.Tensor:
        loc, table = self._reads(layer_id, meta)
        if k is not None:
            self.pool.store(layer_id, loc, k, v)
        out_dtype = q.dtype
        args = {}  # an FP8 pool's descales, an extend step's ragged queries
        if self.fp8:
            # q in e4m3, and the layer's descales as the [B, Hkv] float32 tensors FA3 wants (stride-0 views of the
            # pool's scales: no kernel, and a CUDA graph keeps reading the same scale)
            top = torch.finfo(self.pool.kv_dtype).max
            q = q.clamp(-top, top).to(self.pool.kv_dtype)
            scale, shape = self.pool.kv_scale[layer_id], (table.shape[0], self.num_kv_heads)
            args = {"k_descale": scale[0].expand(shape), "v_descale": scale[1].expand(shape)}
        ragged = meta.cu_seqlens_q is not None
        if ragged:
            args.update(cu_seqlens_q=meta.cu_seqlens_q, max_seqlen_q=meta.max_seqlen_q)
        else:  # decode, or a verify step's queries of one length, [B * Sq] -> [B, Sq]
            q = q.view(-1, meta.max_seqlen_q, *q.shape[1:])
        o = self._attn(q=q, k_cache=self.pool.k[layer_id], v_cache=self.pool.v[layer_id],
                       cache_seqlens=meta.cache_seqlens, page_table=table, causal=True, **self.layer_args[layer_id],
                       **args)
        if not ragged:
            o = o.flatten(0, 1)
        return o if o.dtype == out_dtype else o.to(out_dtype)  # FP8 mode answers in bf16

    def kv_store_target(self, layer_id: int, meta: Any) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
        return self._pool_target(layer_id, self._reads(layer_id, meta)[0])

    def decode_meta(self, loc: torch.Tensor, table: torch.Tensor, seq_lens: torch.Tensor, q_len: int = 1) -> FAMeta:
        """A decode step's metadata over a CUDA graph's static page table (PageTableGraphs), or (as verify_meta) a
        verify step's of q_len queries per request (the last `q_len` positions of each sequence, causal from the
        bottom right as FA3 aligns them)."""
        return FAMeta(loc, table, seq_lens, None, q_len)

    verify_meta = decode_meta

    def init_graph_state(self, max_bs: int, max_seq_len: int) -> None:
        super().init_graph_state(max_bs, max_seq_len)
        if self.window_table is not None:
            self.static_window = StaticPageTable(max_bs, max_seq_len, self.page_size, self.device)
            self.g_window_loc = torch.zeros((max_bs,), dtype=torch.int64, device=self.device)
            self.graph_batches: Dict[int, ForwardBatch] = {}

    def prepare_for_capture(self, b: ForwardBatch) -> FAMeta:
        meta = super().prepare_for_capture(b)
        if self.window_table is None:
            return meta
        bs = b.batch_size
        self.graph_batches[bs] = b  # the graph's own inputs, which hold each replay's batch and padding rows
        require(self.static_window).fill(self.window_table, b, bs)
        return dataclasses.replace(meta, window_loc=window_slots(self.window_table, b, self.g_window_loc[:bs]),
                                   window_table=self.static_window.rows(bs)[0])

    def prepare_for_replay(self, b: ForwardBatch, padded_bs: int, meta: FAMeta) -> None:
        super().prepare_for_replay(b, padded_bs, meta)
        if self.window_table is not None:
            require(self.static_window).fill(self.window_table, b, padded_bs)
            window_slots(self.window_table, self.graph_batches[padded_bs], meta.window_loc)

    def verify_backend(self) -> Optional["FlashAttentionBackend"]:
        return self if self.window_table is None else None  # (verify graphs read the full table only)
