"""Decode attention on the CPU that reads K and V in place in the paged pool (cpu_attention.c), beside the torch
computation it is tested against.

The torch way, gathering each request's keys into a padded [B, max_len] table for every layer and masking the
padding, copies the whole batch's KV once per layer and computes the padded scores; the kernel follows the page
table inside the attention instead: each K/V row is read once, nothing is copied, nothing is padded.
"""
from __future__ import annotations

import ctypes
from typing import Optional

import torch

from .cpu_build import FLOAT, I64, INT, PTR, CompiledKernels, c_function


class PagedDecodeKernel(CompiledKernels):
    """The compiled kernel, for float32 pools; `PagedDecodeKernel.load()` is None where it cannot be built."""

    SOURCE = "cpu_attention"

    def __init__(self, lib: ctypes.CDLL, how: str) -> None:
        self.fn = c_function(lib, "paged_decode_f32", INT, PTR, I64, PTR, PTR, PTR, I64, PTR, I64, PTR, PTR, INT, INT,
                             INT, INT, FLOAT, INT, FLOAT, PTR)
        self.how = how

    @staticmethod
    def supports(pool_dtype: torch.dtype, kv_dtype: torch.dtype, num_q_heads: int, num_kv_heads: int) -> bool:
        return pool_dtype == kv_dtype == torch.float32 and num_q_heads % num_kv_heads == 0

    def __call__(self, q: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor, req_to_token: torch.Tensor,
                 rows: torch.Tensor, kv_lens: torch.Tensor, scale: float, window: int = 0,
                 softcap: float = 0.0, sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
        """q: [B, Hq, D] float32 (rows may be strided, heads and dims contiguous); k_flat / v_flat: the layer's pool
        [slots, Hkv, D] (rows `stride(0)` apart); req_to_token [rows, ctx] int32; rows [B] int64; kv_lens [B] int32
        (each request's keys are positions 0 .. kv_len - 1, this step's included); window: a query's last `window`
        keys only (0: all); softcap: scores s -> softcap * tanh(s / softcap) (0: none); sinks: float32 [Hq], each
        head's sink logit (None: none). Returns [B, Hq, D]."""
        bsz, hq, d = q.shape
        hkv = k_flat.shape[1]
        if q.stride(2) != 1 or q.stride(1) != d:
            q = q.contiguous()
        if k_flat.stride()[1:] != (d, 1) or v_flat.stride() != k_flat.stride():
            raise ValueError("K and V must be [slots, Hkv, D] rows with the same strides")
        if not (req_to_token.dtype == kv_lens.dtype == torch.int32 and rows.dtype == torch.int64):
            raise ValueError("req_to_token and kv_lens int32, rows int64")
        if req_to_token.stride(1) != 1:
            raise ValueError("req_to_token rows must be contiguous")
        rows, kv_lens = rows.contiguous(), kv_lens.contiguous()
        if sinks is not None and (sinks.dtype != torch.float32 or sinks.numel() != hq):
            raise ValueError(f"sinks: float32 [{hq}], got {sinks.dtype} {tuple(sinks.shape)}")
        sinks = sinks.contiguous() if sinks is not None else None
        out = torch.empty((bsz, hq, d), dtype=torch.float32)
        rc = self.fn(q.data_ptr(), q.stride(0), out.data_ptr(), k_flat.data_ptr(), v_flat.data_ptr(),
                     k_flat.stride(0), req_to_token.data_ptr(), req_to_token.stride(0), rows.data_ptr(),
                     kv_lens.data_ptr(), bsz, hq, hkv, d, scale, window, softcap,
                     sinks.data_ptr() if sinks is not None else None)
        if rc != 0:
            raise MemoryError("paged decode attention could not allocate its scratch memory")
        return out


def paged_decode_reference(q: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor,
                           req_to_token: torch.Tensor, rows: torch.Tensor, kv_lens: torch.Tensor,
                           scale: float, window: int = 0, softcap: float = 0.0,
                           sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The same in float64, a request at a time: what the kernel is tested against (a sink as one more score whose
    weight is dropped)."""
    bsz, hq, d = q.shape
    g = hq // k_flat.shape[1]
    out = torch.empty((bsz, hq, d), dtype=torch.float64)
    for b in range(bsz):
        n = int(kv_lens[b])
        slots = req_to_token[rows[b], max(0, n - window) if window else 0:n].long()
        kk = k_flat[slots].double().repeat_interleave(g, dim=1)  # [L, Hq, D]
        vv = v_flat[slots].double().repeat_interleave(g, dim=1)
        s = torch.einsum("hd,lhd->hl", q[b].double(), kk) * scale
        if softcap:
            s = torch.tanh(s / softcap) * softcap
        if sinks is not None:
            s = torch.cat([s, sinks.double()[:, None]], dim=1)
        out[b] = torch.einsum("hl,lhd->hd", s.softmax(-1)[:, :len(slots)], vv)
    return out
