"""RMSNorm, one class per kernel path, chosen when the model is built (`make_norm`):

- RMSNorm: norm(x), or with the residual (norm(x + residual), x + residual), through the model's LayerOps.
- Fp8OutRMSNorm: an FP8 projection takes the output, so on CUDA the norm hands it over quantised per token
  (fp8.Fp8Activations), from one kernel (kernels/fp8_quant.py); elsewhere as RMSNorm.
- ExpertSumRMSNorm: the norm after a sparse MLP that hands its k expert outputs over unsummed (UnsummedExperts,
  moe.SparseMoE): on CUDA it sums them in the same kernel as the residual add and the norm
  (kernels/moe_sum_norm.py); elsewhere torch sums them first. ExpertSumFp8OutRMSNorm: the same before an FP8
  projection (torch's sum, then the quantised norm).
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import torch
from torch import nn

from minisrv.distributed import TensorParallel
from minisrv.kernels.fp8_quant import fused_quantisers
from minisrv.kernels.moe_sum_norm import triton_sum_add_rmsnorm

from .layer_ops import LayerOps


class UnsummedExperts(NamedTuple):
    """A sparse MLP's output left as each token's k weighted expert outputs, parts [T, k, H]: the norm after the
    layer (the next layer's input norm, or the model's final norm: an ExpertSumRMSNorm) sums them as it adds the
    residual."""

    parts: torch.Tensor


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


class ExpertSumRMSNorm(RMSNorm):
    sum_in_kernel = True  # the sum, the add and the norm in one kernel where it runs

    def forward(self, x, residual: Optional[torch.Tensor] = None):
        """x: a tensor, or UnsummedExperts."""
        if isinstance(x, UnsummedExperts):
            kernel = triton_sum_add_rmsnorm() if self.sum_in_kernel and residual is not None and x.parts.is_cuda \
                else None
            if kernel is not None:
                return kernel(x.parts, residual, self.weight, self.eps), residual
            x = x.parts.sum(dim=1)
        return super().forward(x, residual)


class ExpertSumFp8OutRMSNorm(ExpertSumRMSNorm, Fp8OutRMSNorm):
    sum_in_kernel = False  # the sum kernel hands out no FP8: torch sums, the quantising norm follows


def make_norm(dim: int, eps: float, ops: LayerOps, quantize_out: bool = False,
              after_experts: bool = False) -> RMSNorm:
    """The norm for its place: before an FP8 projection (quantize_out), after a sparse MLP whose output comes
    unsummed (after_experts)."""
    if after_experts:
        return ExpertSumFp8OutRMSNorm(dim, eps, ops) if quantize_out else ExpertSumRMSNorm(dim, eps, ops)
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
