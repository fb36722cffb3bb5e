"""RMSNorm, one class per kernel path, chosen when the model is built (`make_norm`):

- RMSNorm: norm(x), or with the residual (norm(x + residual), x + residual), through the model's LayerOps.
- Fp8OutRMSNorm: an FP8 projection takes the output, so on CUDA the norm hands it over quantised per token
  (fp8.Fp8Activations), from one kernel (kernels/fp8_quant.py); elsewhere as RMSNorm.
- GemmaRMSNorm: Gemma's, which scales by (1 + weight), computed in float32 as transformers does (its checkpoints
  store the weight less one).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import nn

from minisrv.distributed import TensorParallel
from minisrv.kernels.fp8_quant import fused_quantisers

from .layer_ops import LayerOps


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, ops: Optional[LayerOps] = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.ops = ops if ops is not None else LayerOps()

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        """Without residual: norm(x). With residual: (norm(x + residual), x + residual)."""
        if residual is None:
            return self.ops.rmsnorm(x, self.weight, self.eps)
        return self.ops.add_rmsnorm(x, residual, self.weight, self.eps)


class Fp8OutRMSNorm(RMSNorm):
    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        quantisers = fused_quantisers(x) if residual is None or residual.stride(-1) == 1 else None
        if quantisers is None:
            return super().forward(x, residual)
        out = quantisers.add_norm_quant(x, residual, self.weight, self.eps)
        return out if residual is None else (out, residual)


class GemmaRMSNorm(RMSNorm):
    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        if residual is not None:
            x = residual = x + residual
        xf = x.float()
        out = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight.float())).type_as(x)
        return out if residual is None else (out, residual)


def make_norm(dim: int, eps: float, ops: LayerOps, quantize_out: bool = False, plus_one: bool = False) -> RMSNorm:
    """The norm for its place: GemmaRMSNorm where the weight is stored less one (plus_one), Fp8OutRMSNorm before an
    FP8 projection (quantize_out), else RMSNorm."""
    if plus_one:
        return GemmaRMSNorm(dim, eps, ops)
    return Fp8OutRMSNorm(dim, eps, ops) if quantize_out else RMSNorm(dim, eps, ops)


def reduce_add_norm(tp: TensorParallel, norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor,
                    x_is_partial: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """(norm(sum + residual), sum + residual), where sum is x all-reduced over the ranks if `x_is_partial` (a
    row-parallel projection's output whose all-reduce was deferred to here), else x itself. With the group's
    fused kernel (tp.fused_norm) the all-reduce, the add and the norm are one kernel instead of two."""
    if x_is_partial:
        fused = tp.fused_norm
        if fused is not None and fused.fits(x):
            return fused(x, residual, norm.weight, norm.eps)
        x = tp.all_reduce(x)
    return norm(x, residual)
