"""An attention layer's work between its qkv projection and the attention kernel, in one Triton launch: Qwen3's
per-head RMSNorm of q and k (where the model has it), the rotary embedding of q and k (neox style, rotating halves),
and the store of the new k and v into the KV pool at the step's slots.

Why: at decode these are four launches (FlashInfer's q norm, k norm and rotary, torch's indexed store into the pool)
of a few microseconds each, a large share of a layer at batch 1, where the work itself is a few kilobytes. One
program per token reads its q, k and v once and writes q in place, k in place and, with a pool, k and v at the
token's slot.

The arithmetic is FlashInfer's, which the unfused CUDA path uses: the norm in float32 (x * rsqrt(mean(x^2) + eps) *
weight), rounded to the model's dtype, then the rotation in float32 from the float32 cos/sin cache ([positions,
head_dim]: cos in the first half, sin in the second), rounded once. `reference` is the same in torch.
"""
from __future__ import annotations

from types import ModuleType
from typing import Callable, Optional

import torch

from minisrv.kernels.triton_launcher import triton_launcher


def reference(qkv: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, num_q_heads: int,
              num_kv_heads: int, head_dim: int, q_weight: Optional[torch.Tensor], k_weight: Optional[torch.Tensor],
              eps: float, kv: Optional[torch.Tensor] = None, slots: Optional[torch.Tensor] = None) -> None:
    """The kernel's effect in torch ops: qkv [T, (Hq + 2 Hkv) D] changed in place (q and k normed and rotated);
    with kv (a pool layer's [2, ..., Hkv, D] tensor) k and v also written at `slots`."""
    t, d, half = qkv.shape[0], head_dim, head_dim // 2
    q = qkv[:, :num_q_heads * d].view(t, num_q_heads, d)
    k = qkv[:, num_q_heads * d:(num_q_heads + num_kv_heads) * d].view(t, num_kv_heads, d)
    v = qkv[:, (num_q_heads + num_kv_heads) * d:].view(t, num_kv_heads, d)
    cos = cos_sin[positions, None, :half].float()
    sin = cos_sin[positions, None, half:].float()
    for x, w in ((q, q_weight), (k, k_weight)):
        h = x.float()
        if w is not None:
            h = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype).float()
        x1, x2 = h[..., :half], h[..., half:]
        x.copy_(torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype))
    if kv is not None:
        flat = kv.view(2, -1, num_kv_heads, d)
        flat[0][slots] = k
        flat[1][slots] = v


@triton_launcher
def triton_qk_rope_store(triton: ModuleType, tl: ModuleType) -> Callable[..., None]:
    """The launcher `run(qkv, positions, cos_sin, num_q_heads, num_kv_heads, head_dim, q_weight, k_weight, eps,
    kv=None, slots=None)` (reference's contract), or None where Triton is missing. qkv's rows may be strided; its
    columns are contiguous; head_dim a power of two; kv of qkv's dtype."""

    @triton.jit
    def qk_norm_rope_store(qkv_ptr, stride_t, positions_ptr, cos_sin_ptr, q_weight_ptr, k_weight_ptr, eps, kv_ptr,
                           slots_ptr, v_offset, HQ: tl.constexpr, HKV: tl.constexpr, HEADS_POW2: tl.constexpr,
                           HALF: tl.constexpr, NORM: tl.constexpr, STORE: tl.constexpr):
        """One token: its q heads then its k heads as rows [HEADS_POW2, HALF] of two halves (the rows past the
        part's heads masked off), normed, rotated and written back; then k and v at the token's slot."""
        t = tl.program_id(0).to(tl.int64)
        pos = tl.load(positions_ptr + t).to(tl.int64)
        d = tl.arange(0, HALF)
        h = tl.arange(0, HEADS_POW2)
        cos = tl.load(cos_sin_ptr + pos * (2 * HALF) + d)[None, :]
        sin = tl.load(cos_sin_ptr + pos * (2 * HALF) + HALF + d)[None, :]
        row = qkv_ptr + t * stride_t
        at = h[:, None] * (2 * HALF) + d[None, :]
        for part in tl.static_range(2):  # 0: q, 1: k
            heads = HQ if part == 0 else HKV
            weight_ptr = q_weight_ptr if part == 0 else k_weight_ptr
            ptr = row + part * (HQ * 2 * HALF) + at
            mask = (h < heads)[:, None]
            x1 = tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
            x2 = tl.load(ptr + HALF, mask=mask, other=0.0).to(tl.float32)
            if NORM:
                rstd = 1.0 / tl.sqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF) + eps)
                w1 = tl.load(weight_ptr + d).to(tl.float32)[None, :]
                w2 = tl.load(weight_ptr + HALF + d).to(tl.float32)[None, :]
                x1 = (x1 * rstd[:, None] * w1).to(qkv_ptr.dtype.element_ty).to(tl.float32)
                x2 = (x2 * rstd[:, None] * w2).to(qkv_ptr.dtype.element_ty).to(tl.float32)
            o1 = (x1 * cos - x2 * sin).to(qkv_ptr.dtype.element_ty)
            o2 = (x2 * cos + x1 * sin).to(qkv_ptr.dtype.element_ty)
            tl.store(ptr, o1, mask=mask)
            tl.store(ptr + HALF, o2, mask=mask)
            if STORE and part == 1:
                slot = tl.load(slots_ptr + t).to(tl.int64)
                dst = kv_ptr + slot * (HKV * 2 * HALF) + at
                tl.store(dst, o1, mask=mask)
                tl.store(dst + HALF, o2, mask=mask)
                v_ptr = row + (HQ + HKV) * 2 * HALF + at
                tl.store(dst + v_offset, tl.load(v_ptr, mask=mask), mask=mask)
                tl.store(dst + v_offset + HALF, tl.load(v_ptr + HALF, mask=mask), mask=mask)

    def run(qkv: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, num_q_heads: int, num_kv_heads: int,
            head_dim: int, q_weight: Optional[torch.Tensor], k_weight: Optional[torch.Tensor], eps: float,
            kv: Optional[torch.Tensor] = None, slots: Optional[torch.Tensor] = None) -> None:
        t = qkv.shape[0]
        if t == 0:
            return
        if qkv.stride(1) != 1 or head_dim & (head_dim - 1) or cos_sin.dtype != torch.float32:
            raise ValueError(f"qk_rope_store: qkv strides {qkv.stride()}, head_dim {head_dim}, cos_sin {cos_sin.dtype}")
        norm = q_weight is not None
        store = kv is not None
        if store and (kv.dtype != qkv.dtype or slots is None or not kv.is_contiguous()):
            raise ValueError(f"qk_rope_store: a pool of {kv.dtype} (qkv {qkv.dtype}), slots {slots is not None}")
        v_offset = kv[0].numel() if store else 0
        qk_norm_rope_store[(t,)](qkv, qkv.stride(0), positions, cos_sin, q_weight if norm else qkv,
                                 k_weight if norm else qkv, eps, kv if store else qkv, slots if store else positions,
                                 v_offset, HQ=num_q_heads, HKV=num_kv_heads,
                                 HEADS_POW2=triton.next_power_of_2(max(num_q_heads, num_kv_heads)), HALF=head_dim // 2,
                                 NORM=norm, STORE=store, num_warps=4)

    return run


def fused_qk_rope_store(qkv: torch.Tensor, cos_sin: torch.Tensor, head_dim: int) -> Optional[Callable[..., None]]:
    """The launcher where it runs for this qkv output (CUDA, Triton present), else None (the caller takes the
    separate norm, rotary and store). None also for a partial rotary (cos_sin narrower than a head, Phi-4-mini's):
    the kernel turns whole heads, and such models take FlashInfer's rotary, which turns the cache's width of each
    head, and the backend's store."""
    return triton_qk_rope_store() if qkv.is_cuda and cos_sin.shape[-1] == head_dim else None


def warm_up(device: torch.device, dtype: torch.dtype, num_q_heads: int, num_kv_heads: int, head_dim: int,
            norm: bool, store: bool) -> None:
    """Import Triton and compile (or load from Triton's cache) the kernel as a model of these shapes will call it,
    by running it once on two tokens of zeros: a start-up job run beside the weights' loading
    (engine/kernel_builds.py), so that neither lands in the first forward pass."""
    run = triton_qk_rope_store()
    if run is None or device.type != "cuda":
        return
    with torch.cuda.device(device):
        qkv = torch.zeros(2, (num_q_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, device=device)
        ids = torch.zeros(2, dtype=torch.int64, device=device)
        cos_sin = torch.zeros(1, head_dim, dtype=torch.float32, device=device)
        weight = torch.ones(head_dim, dtype=dtype, device=device) if norm else None
        pool = torch.zeros(2, 1, 16, num_kv_heads, head_dim, dtype=dtype, device=device) if store else None
        run(qkv, ids, cos_sin, num_q_heads, num_kv_heads, head_dim, weight, weight, 1e-6, pool,
            ids if store else None)
        torch.cuda.current_stream(device).synchronize()
