"""The layers' fused elementwise ops on the CPU (cpu_ops.c), under the names and signatures of FlashInfer's that the
layers call on CUDA (models/layers.py: `fused`), so a layer runs the same code on both.

Each op takes float32 tensors whose rows have contiguous elements; anything else (another dtype, an odd layout)
goes through the plain torch computation the layers use without fused ops, so the result is always theirs.
"""
from __future__ import annotations

import ctypes
import functools
import logging
from typing import Any, Optional

import torch
import torch.nn.functional as F

from .cpu_blocks import BlockKernels
from .cpu_build import FLOAT, I64, INT, PTR, c_function, load_cpu_library
from .cpu_decode import DecodeLayersKernel
from .cpu_gemv import SmallBatchLinear

logger = logging.getLogger(__name__)


def _rows_ok(x: torch.Tensor) -> bool:
    return x.dtype == torch.float32 and x.stride(-1) == 1 and not x.requires_grad


def torch_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * norm(x) over the last dim, computed in float32 and rounded to x's dtype before the weight (HF's)."""
    h = x.float()
    return weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _built(load: Any, what: str) -> Any:
    """What `load()` builds, or None with the reason logged."""
    kernel, how = load()
    if kernel is None:
        logger.info("%s unavailable: %s", what, how)
    return kernel


class CpuFusedOps:
    """What `fused` is on the CPU when the kernels build (`CpuFusedOps.load()`; None where they cannot)."""

    def __init__(self, lib: ctypes.CDLL, how: str, small_batch_linear: Optional[SmallBatchLinear] = None) -> None:
        self.how = how
        self.small_batch_linear = small_batch_linear  # the projections' kernel at a few rows (cpu_gemv.py)
        self._norm = c_function(lib, "rmsnorm_f32", None, PTR, PTR, I64, I64, I64, I64, I64, I64, PTR, INT, FLOAT)
        self._add_norm = c_function(lib, "add_rmsnorm_f32", None, PTR, I64, PTR, I64, PTR, I64, INT, FLOAT)
        self._silu_mul = c_function(lib, "silu_mul_f32", None, PTR, I64, PTR, I64, INT)
        self._rope = c_function(lib, "rope_neox_f32", None, PTR, PTR, I64, INT, PTR, I64, INT, INT, INT, PTR, I64)

    @functools.cached_property
    def block_kernels(self) -> Optional[BlockKernels]:
        """The projections' kernels over a GGUF model's blocks (cpu_blocks.py), built when a model first asks."""
        return _built(BlockKernels.load, "CPU block kernels")

    @functools.cached_property
    def decode_layers(self) -> Optional[DecodeLayersKernel]:
        """A decode step's layers in one call over block weights (cpu_decode.py), built when a model first asks."""
        return _built(DecodeLayersKernel.load, "CPU decode layers in one call")

    @staticmethod
    def load() -> "tuple[Optional[CpuFusedOps], str]":
        lib, how = load_cpu_library("cpu_ops")
        if lib is None:
            return None, how
        small, _ = SmallBatchLinear.load()
        return CpuFusedOps(lib, how, small), how + ("" if small is not None else "; no small-batch projections")

    def rmsnorm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """norm(x) * weight over the last dim of a 2-D [rows, dim] or 3-D [T, H, dim] x; into `out` if given."""
        if out is None:
            out = torch.empty(x.shape, dtype=x.dtype)
        if not (x.dim() in (2, 3) and _rows_ok(x) and _rows_ok(out) and weight.dtype == torch.float32
                and weight.is_contiguous()):
            out.copy_(torch_rmsnorm(x, weight, eps))
            return out
        outer, inner = (x.shape[0], 1) if x.dim() == 2 else (x.shape[0], x.shape[1])
        x_si = 0 if x.dim() == 2 else x.stride(1)
        o_si = 0 if x.dim() == 2 else out.stride(1)
        self._norm(x.data_ptr(), out.data_ptr(), outer, inner, x.stride(0), x_si, out.stride(0), o_si,
                   weight.data_ptr(), x.shape[-1], eps)
        return out

    def fused_add_rmsnorm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
        """In place: residual += x, then x = norm(residual) * weight."""
        if not (x.dim() == 2 and _rows_ok(x) and _rows_ok(residual) and x.shape == residual.shape
                and weight.dtype == torch.float32 and weight.is_contiguous()):
            residual.add_(x)
            x.copy_(torch_rmsnorm(residual, weight, eps))
            return
        self._add_norm(x.data_ptr(), x.stride(0), residual.data_ptr(), residual.stride(0), weight.data_ptr(),
                       x.shape[0], x.shape[1], eps)

    def silu_and_mul(self, gu: torch.Tensor) -> torch.Tensor:
        inter = gu.shape[-1] // 2
        if not (gu.dim() == 2 and _rows_ok(gu)):
            g, u = gu.chunk(2, dim=-1)
            return F.silu(g) * u
        out = torch.empty((gu.shape[0], inter), dtype=gu.dtype)
        self._silu_mul(gu.data_ptr(), gu.stride(0), out.data_ptr(), gu.shape[0], inter)
        return out

    def apply_rope_with_cos_sin_cache_inplace(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                                              head_size: int, cos_sin_cache: torch.Tensor, is_neox: bool) -> None:
        """q [T, Hq * D], k [T, Hkv * D] rotated in place at `positions`; cos_sin_cache [P, R] float32, turning the
        first R <= D dims of each head (as FlashInfer's)."""
        if not is_neox:
            raise ValueError("only neox-style rotary")
        t, r = q.shape[0], cos_sin_cache.shape[1]
        if (_rows_ok(q) and _rows_ok(k) and cos_sin_cache.dtype == torch.float32 and cos_sin_cache.is_contiguous()
                and positions.dtype == torch.int64 and positions.is_contiguous()):
            self._rope(positions.data_ptr(), q.data_ptr(), q.stride(0), q.shape[1] // head_size, k.data_ptr(),
                       k.stride(0), k.shape[1] // head_size, head_size, r, cos_sin_cache.data_ptr(), t)
            return
        half = r // 2
        cos = cos_sin_cache[positions, :half].unsqueeze(1)
        sin = cos_sin_cache[positions, half:].unsqueeze(1)
        for x in (q, k):
            xv = x.view(t, -1, head_size)[..., :r]
            x1, x2 = xv.float().chunk(2, dim=-1)
            xv.copy_(torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1))
