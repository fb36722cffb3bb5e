"""Decode steps on minisrv's own Triton kernel (kernels/decode_attention.py), as the decode half of a hybrid backend
(`--attention-backend fa,triton`); prefill and extend steps belong to the other half.

The kernel takes FA3's description of the batch (page table [B, max_pages] and lengths [B], int32), so the step's
metadata is one gather from the request->token table and nothing is planned on the host; the CUDA-graph form is the
same static page table FA3 and XQA use. New tokens' k/v are in the pool before the kernel reads it (the fused
rotary + store writes them, or `forward` does).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from minisrv.kernels.decode_attention import takes_head_dim, triton_decode_attention

from .base import AttentionBackend
from .page_table import DecodePages, PageTableGraphs

if TYPE_CHECKING:
    from minisrv.kvcache import KVPool


class TritonDecodeBackend(PageTableGraphs, AttentionBackend):
    name = "triton"
    supports_cuda_graph = True

    def __init__(self, pool: "KVPool", req_to_token: torch.Tensor, num_q_heads: int, layers=None) -> None:
        super().__init__(pool, req_to_token, num_q_heads, layers)
        self.kernel = triton_decode_attention()
        if self.kernel is None:
            raise ImportError("the triton decode backend needs Triton")
        if not takes_head_dim(self.head_dim):
            raise ValueError(f"the triton decode kernel needs a power-of-two head_dim of at least 16; this model's is "
                             f"{self.head_dim}: use another attention backend")

    def attend(self, q: torch.Tensor, layer_id: int, meta: DecodePages) -> torch.Tensor:
        pool = self.pool
        return self.kernel(q, pool.k[layer_id], pool.v[layer_id], meta.page_table, meta.seq_lens,
                           self.layers[layer_id].scale, pool.k_scale_host[layer_id], pool.v_scale_host[layer_id])
