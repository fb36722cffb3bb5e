"""Portable attention over the paged pool with torch's SDPA: runs on CPU and any CUDA GPU.

It is the reference the fast backends are tested against, and the CPU serving path. Each step it gathers every
request's K/V into a padded [B, max_len] table (once per layer, from indices planned once per step) and runs one
batched SDPA with a mask that is causal with respect to each request's cached prefix (and, for a layer with a
sliding window, within it: one mask per window the model has). An FP8 pool's K/V are
dequantised as they are gathered (the pool's `load`), so attention itself runs in the model's dtype on any device.

On the CPU, the paths of cpu_paged.py replace that one where they can: decode reads K/V in place in the pool through
a compiled kernel, and prompts run packed, a sequence at a time, without padding. The padded path stays for FP8
pools, for decode where the kernel could not be built, and on CUDA, where it is the reference.

Where the pool's windowed layers keep only their window (kvcache/pool.py), they have slots of their own, mapped by a
second request->token table (`window_table`): a step is planned twice, once over each table (`KindMetas`), and each
layer reads its kind's plan. Keys of a windowed layer before its window hold stale slots there, which the window's
mask keeps out.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional

import torch

from minisrv.batch import ForwardBatch
from minisrv.kernels.cpu_decode import DecodeMeta

from .base import AttentionBackend
from .cpu_paged import CpuPagedAttention, PackedMeta, attend
from .page_table import window_slots


@dataclass(frozen=True)
class TorchMeta:
    loc: torch.Tensor  # [T] slots the step's k/v go to
    kv_idx: torch.Tensor  # [B, max_k] slots of each request's keys
    masks: Dict[Optional[int], torch.Tensor]  # window -> [B, max_q, max_k]: causal with respect to each request's
    # cached prefix, within the window
    max_q: int
    q_gather: Optional[torch.Tensor]  # padded (i, j) -> token row; None when every request has one query
    out_rows: Optional[torch.Tensor]  # token rows inside the padded output


@dataclass(frozen=True)
class KindMetas:
    """A step's plan over the full layers' slots and over the windowed layers' own."""

    full: Any
    window: Any


class TorchNativeBackend(AttentionBackend):
    name = "torch"

    def __init__(self, pool, req_to_token: torch.Tensor, num_q_heads: int, layers=None,
                 window_table: Optional[torch.Tensor] = None) -> None:
        super().__init__(pool, req_to_token, num_q_heads, layers)
        self.windows = {a.window for a in self.layers}
        self.sinks = [a.sinks_tensor(pool.device) for a in self.layers]  # each layer's, [Hq] float32 or None
        self.window_table = window_table
        self.cpu = CpuPagedAttention.create(pool, num_q_heads, self.layers) if pool.device.type == "cpu" else None

    def prepare(self, b: ForwardBatch):
        if self.window_table is None:
            return self._prepare(b, self.req_to_token, b.out_cache_loc)
        window = self._prepare(b, self.window_table, window_slots(self.window_table, b))
        if len(self.pool.window_layers) == self.pool.num_layers:
            return window
        return KindMetas(self._prepare(b, self.req_to_token, b.out_cache_loc), window)

    def _prepare(self, b: ForwardBatch, table: torch.Tensor, loc: torch.Tensor):
        meta = self.cpu.prepare(b, table, loc) if self.cpu is not None else None  # None: a step it does not serve
        return meta if meta is not None else self.prepare_padded(b, table, loc)

    def prepare_padded(self, b: ForwardBatch, table: Optional[torch.Tensor] = None,
                       loc: Optional[torch.Tensor] = None) -> TorchMeta:
        dev = b.input_ids.device
        bsz = b.batch_size
        max_k = b.max_seq_len
        ext = b.extend_lens_cpu
        max_q = max(ext)
        if max_q * bsz == 0:
            raise ValueError("empty batch")
        table = self.req_to_token if table is None else table
        kv_idx = table[b.req_rows, :max_k].long()  # [B, max_k]
        # padded query row j of request i sits at absolute position prefix_i + min(j, ext_i - 1): padded rows
        # repeat the last real one, so no row is fully masked, and are dropped afterwards
        ext_t = torch.tensor(ext, dtype=torch.int64)
        j = torch.arange(max_q, dtype=torch.int64)
        jj = torch.minimum(j[None, :], ext_t[:, None] - 1)  # [B, max_q]
        prefix = torch.tensor(b.prefix_lens_cpu, dtype=torch.int64)
        q_pos = (prefix[:, None] + jj).to(dev)
        k_pos = torch.arange(max_k, device=dev)[None, None, :]
        causal = k_pos <= q_pos[:, :, None]
        masks = {w: causal if w is None else causal & (k_pos > q_pos[:, :, None] - w) for w in self.windows}
        q_gather = out_rows = None
        if max_q > 1:
            starts = torch.tensor([0] + ext[:-1], dtype=torch.int64).cumsum(0)
            q_gather = (starts[:, None] + jj).reshape(-1).to(dev)
            valid = (j[None, :] < ext_t[:, None]).reshape(-1)
            out_rows = torch.nonzero(valid).squeeze(1).to(dev)
        return TorchMeta(b.out_cache_loc if loc is None else loc, kv_idx, masks, max_q, q_gather, out_rows)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, meta) -> torch.Tensor:
        if isinstance(meta, KindMetas):
            meta = meta.window if layer_id in self.pool.window_layers else meta.full
        if isinstance(meta, (DecodeMeta, PackedMeta)):
            return self.cpu.forward(q, k, v, layer_id, meta)
        self.pool.store(layer_id, meta.loc, k, v)
        bsz, max_q = meta.kv_idx.shape[0], meta.max_q
        hkv, d = self.num_kv_heads, self.head_dim
        g = self.num_q_heads // hkv
        kk, vv = self.pool.load(layer_id, meta.kv_idx)  # [B, L, Hkv, D], dequantised from an FP8 pool
        kk, vv = kk.transpose(1, 2), vv.transpose(1, 2)  # [B, Hkv, L, D]
        qp = q if meta.q_gather is None else q[meta.q_gather]
        # fold the GQA group into the query length: [B, Hkv, G * max_q, D], no K/V repeat needed
        qp = qp.view(bsz, max_q, hkv, g, d).permute(0, 2, 3, 1, 4).reshape(bsz, hkv, g * max_q, d)
        opts = self.layers[layer_id]
        mask = meta.masks[opts.window]
        mask = mask[:, None, None].expand(bsz, 1, g, max_q, mask.shape[-1]).reshape(bsz, 1, g * max_q, -1)
        sinks = self.sinks[layer_id]  # [Hq] -> the folded rows' [1, Hkv, G * max_q, 1]
        sinks = sinks.view(1, hkv, g, 1).expand(1, hkv, g, max_q).reshape(1, hkv, g * max_q, 1) \
            if sinks is not None else None
        o = attend(qp, kk, vv, mask, opts, sinks)
        o = o.view(bsz, hkv, g, max_q, d).permute(0, 3, 1, 2, 4).reshape(bsz * max_q, hkv * g, d)
        return o if meta.q_gather is None else o[meta.out_rows]
