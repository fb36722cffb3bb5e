"""The sum over a mixture-of-experts layer's k expert outputs, fused into the residual add and RMSNorm that follow it
(the next layer's input norm, or the model's final norm), in one Triton launch.

Why: the fused experts (fused_moe.py) leave each token's k weighted expert outputs side by side, [T, k, H]; summed
by torch (a reduction kernel) and then added and normed by FlashInfer, that is two launches a layer for work one
pass over the outputs does. One program per token sums its k rows in float32, rounds the sum to the model's dtype
(as the separate sum does), adds the residual and writes the new residual and the normed row (FlashInfer's
fused_add_rmsnorm's arithmetic: float32 throughout, x * rsqrt(mean(x^2) + eps) * weight, rounded once).
"""
from __future__ import annotations

from types import ModuleType
from typing import Callable

import torch

from minisrv.kernels.triton_launcher import triton_launcher


def reference(parts: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The kernel's effect in torch: parts [T, k, H] summed (rounded to their dtype) and added to residual [T, H]
    (in place); returns the sum's RMSNorm [T, H]."""
    x = parts.float().sum(dim=1).to(parts.dtype).float() + residual.float()
    residual.copy_(x.to(residual.dtype))
    return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(parts.dtype)


@triton_launcher
def triton_sum_add_rmsnorm(triton: ModuleType, tl: ModuleType) -> Callable[..., torch.Tensor]:
    """The launcher `run(parts, residual, weight, eps)` (reference's contract), or None where Triton is missing.
    parts contiguous; residual's rows may be strided, its columns contiguous."""

    @triton.jit
    def moe_sum_add_norm(parts_ptr, residual_ptr, weight_ptr, out_ptr, stride_r, hidden, eps, K: tl.constexpr,
                         BLOCK: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < hidden
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for j in tl.static_range(K):
            acc += tl.load(parts_ptr + (t * K + j) * hidden + cols, mask=mask, other=0.0).to(tl.float32)
        x = acc.to(parts_ptr.dtype.element_ty).to(tl.float32)
        x += tl.load(residual_ptr + t * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(residual_ptr + t * stride_r + cols, x.to(residual_ptr.dtype.element_ty), mask=mask)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / hidden + eps)
        w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + t * hidden + cols, (x * rstd * w).to(out_ptr.dtype.element_ty), mask=mask)

    def run(parts: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        t, k, hidden = parts.shape
        if not parts.is_contiguous() or residual.stride(1) != 1 or tuple(residual.shape) != (t, hidden):
            raise ValueError(f"sum_add_rmsnorm: parts {tuple(parts.shape)} {parts.stride()}, residual "
                             f"{tuple(residual.shape)} {residual.stride()}")
        out = torch.empty(t, hidden, dtype=parts.dtype, device=parts.device)
        if t:
            block = triton.next_power_of_2(hidden)
            moe_sum_add_norm[(t,)](parts, residual, weight, out, residual.stride(0), hidden, eps, K=k, BLOCK=block,
                                   num_warps=max(1, min(8, block // 512)))
        return out

    return run
