"""The elementwise kernels a model's layers call (RMSNorm with and without the residual add, per-head q/k norms,
SiLU-and-mul, neox rotary, the attention layer's q/k norm + rotary + KV store in one kernel), held by one object
that every layer of a model shares: `LayerOps`.

Its target is FlashInfer's module on CUDA, the CPU's compiled ops on the CPU (kernels/cpu_ops.py, which take
FlashInfer's names and signatures), or None: torch's own computation. All compute the same thing (tests compare
against HF transformers). The target is set when the model is built; a server that started before FlashInfer's
kernels were compiled changes it once they are, with `use` (engine/kernel_builds.py): the one change a built model
sees. The CPU's projection kernels (small-batch GEMV, GGUF block kernels, a decode step's layers in one call) are
no elementwise ops: the layers that use them are chosen from `cpu` when the model is built.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Optional, Tuple

import torch
import torch.nn.functional as F

from minisrv.kernels.cpu_ops import CpuFusedOps, torch_rmsnorm
from minisrv.kernels.qk_rope_store import fused_qk_rope_store
from minisrv.utils import cuda_import

logger = logging.getLogger(__name__)


def fused_ops_for(device: torch.device) -> Optional[Any]:
    """FlashInfer's module when on CUDA and importable; on the CPU the compiled CPU ops (CpuFusedOps) where they
    build; None otherwise (plain torch)."""
    if device.type != "cpu":
        return cuda_import(device, "flashinfer")
    ops, how = CpuFusedOps.load()
    logger.info("CPU layer ops: %s; %d threads, CPU capability %s", how if ops is not None else
                f"plain torch ({how})", torch.get_num_threads(), torch.backends.cpu.get_cpu_capability())
    return ops


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox rotary of x's first 2 x cos's width dims; the rest (partial rotary) pass through."""
    r = 2 * cos.shape[-1]
    x1, x2 = x[..., :r].float().chunk(2, dim=-1)
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
    return out if r == x.shape[-1] else torch.cat([out, x[..., r:]], dim=-1)


class LayerOps:
    """The layers' elementwise ops over `kernels` (FlashInfer's module, the CPU's CpuFusedOps, or None: torch)."""

    def __init__(self, kernels: Optional[Any] = None) -> None:
        self.cpu: Optional[CpuFusedOps] = kernels if isinstance(kernels, CpuFusedOps) else None
        self.kernels = kernels

    def use(self, kernels: Optional[Any]) -> None:
        """Serve every layer from `kernels` from now on (None: torch's ops). The caller has no step in flight."""
        self.kernels = kernels

    # the CPU's projection kernels (None elsewhere), chosen from when a model is built
    @property
    def small_batch_linear(self) -> Optional[Any]:
        return self.cpu.small_batch_linear if self.cpu is not None else None

    @property
    def block_kernels(self) -> Optional[Any]:
        return self.cpu.block_kernels if self.cpu is not None else None

    @property
    def decode_layers(self) -> Optional[Any]:
        return self.cpu.decode_layers if self.cpu is not None else None

    # the elementwise ops
    def rmsnorm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if self.kernels is not None and x.dim() == 2:
            return self.kernels.rmsnorm(x, weight, eps)
        return torch_rmsnorm(x, weight, eps)

    def add_rmsnorm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                    eps: float) -> Tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual); with the kernels in place: x becomes the norm, residual the sum."""
        if self.kernels is not None and x.dim() == 2:
            self.kernels.fused_add_rmsnorm(x, residual, weight, eps)
            return x, residual
        x = x + residual
        return torch_rmsnorm(x, weight, eps), x

    def rmsnorm_heads(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """Per-head norms of x [T, H, D] (a strided view of a qkv output); with the kernels in place."""
        if self.kernels is not None:
            self.kernels.rmsnorm(x, weight, eps, out=x)
            return x
        t, h, d = x.shape
        return torch_rmsnorm(x.reshape(-1, d), weight, eps).view(t, h, d)

    def silu_and_mul(self, gu: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of a gated MLP's stacked output gu = [gate | up]."""
        if self.kernels is not None:
            return self.kernels.silu_and_mul(gu)
        g, u = gu.chunk(2, dim=-1)
        return F.silu(g) * u

    def rope(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
             cos_sin: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Neox rotary of q [T, Hq, D] and k [T, Hkv, D] at `positions`; with the kernels in place (k and v then
        stay side by side in the qkv output: one scatter stores both). cos_sin [P, R]: the rotary's float32 cache,
        each position's cos then its sin, for the first R dims of each head (R < D: partial rotary, the rest pass
        through; FlashInfer's rotary takes R from the cache's width as the CPU's does)."""
        if self.kernels is not None:
            t = q.shape[0]
            qf, kf = q.reshape(t, -1), k.reshape(t, -1)
            self.kernels.apply_rope_with_cos_sin_cache_inplace(positions, qf, kf, q.shape[-1], cos_sin, True)
            return qf.view_as(q), kf.view_as(k)
        c, s = cos_sin[positions].unsqueeze(1).chunk(2, dim=-1)  # [T, 1, R/2] each
        return _rotate(q, c, s), _rotate(k, c, s)

    def qk_rope_store(self, qkv: torch.Tensor, cos_sin: torch.Tensor,
                      head_dim: int) -> Optional[Callable[..., None]]:
        """The attention layer's q/k norms, rotary and KV store in one kernel (kernels/qk_rope_store.py) where it
        runs beside the kernels (CUDA with Triton) for this rotary; None elsewhere."""
        return fused_qk_rope_store(qkv, cos_sin, head_dim) if self.kernels is not None else None
