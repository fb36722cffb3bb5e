"""Per-token FP8 quantisers: activations [T, K] -> float8_e4m3fn values and one float32 scale a token (max |x| / 448,
dynamic: no calibration). Three Triton launchers, two of which also compute the activation they quantise so that it
never goes to memory in the model's dtype: `silu_mul_quant` (SiLU(gate) * up, the MLP down projection's input) and
`add_norm_quant` (the decoder's residual add and RMSNorm, the qkv and gate/up projections' input).

Why: eager torch takes five kernels to quantise, and a decode step quantises four activations per layer; fusing
three of them into the kernels before them leaves one extra kernel per layer instead of four. Each rounds to the
model's dtype where the unfused path does (after the add and after the norm, HF's order; after SiLU-and-mul), so
the torch references below quantise the same values up to one rounding.
"""
from __future__ import annotations

from types import ModuleType
from typing import Callable, NamedTuple, Optional, Tuple

import torch

from minisrv.kernels.triton_launcher import triton_launcher

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
MIN_SCALE = 1e-12  # an all-zero row or token gets this scale (its quantised values are all 0)


class Fp8Activations(NamedTuple):
    """Activations already quantised per token (q float8 [T, K], scale float32 [T, 1]), as a fused norm hands them
    to the projection after it; `shape` is q's, so layers can size by it."""

    q: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.q.shape


def quantize_rows(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """x [R, C] -> (float8 [R, C], float32 scale [R, 1]) with x ~= q * scale, each row scaled to its own max. The
    torch reference of `quant`, and the quantiser of weights and of activations off CUDA."""
    scale = x.abs().amax(dim=-1, keepdim=True).float().clamp_(min=MIN_SCALE) / FP8_MAX
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8), scale


def silu_mul_reference(gu: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of gu = [gate | up] as `silu_mul_quant` computes it before quantising: in float32, rounded
    once to gu's dtype."""
    g, u = gu.float().chunk(2, dim=-1)
    return (g / (1 + torch.exp(-g)) * u).to(gu.dtype)


def add_norm_reference(x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor,
                       eps: float) -> torch.Tensor:
    """rmsnorm(x + residual) * weight as `add_norm_quant` computes it before quantising, rounding to x's dtype after
    the add, after the normalisation and after the weight (HF's order); residual <- x + residual in place."""
    dtype = x.dtype
    if residual is not None:
        x = (x.float() + residual.float()).to(dtype)
        residual.copy_(x)
    h = x.float()
    normed = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    return (normed.float() * weight.float()).to(dtype)


class FusedQuantisers(NamedTuple):
    """The Triton launchers, each returning Fp8Activations (references: quantize_rows of x, of silu_mul_reference,
    of add_norm_reference)."""

    quant: Callable[[torch.Tensor], Fp8Activations]  # x [T, K]
    silu_mul_quant: Callable[[torch.Tensor], Fp8Activations]  # [gate | up] [T, 2K] -> silu(gate) * up
    # (x, residual or None, weight, eps) -> rmsnorm(x + residual) * weight; residual <- x + residual in place
    add_norm_quant: Callable[[torch.Tensor, Optional[torch.Tensor], torch.Tensor, float], Fp8Activations]


@triton_launcher
def triton_quantisers(triton: ModuleType, tl: ModuleType) -> FusedQuantisers:
    """The launchers, or None where Triton is missing (compiled on first use, for the device of their input)."""

    @triton.jit
    def fused_fp8_quantise(x_ptr, r_ptr, w_ptr, q_ptr, s_ptr, n, stride, r_stride, eps, BLOCK: tl.constexpr,
                           MODE: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
        """MODE 0: quantise x's row; 1: x's row is [gate | up] (2n wide), quantise silu(gate) * up; 2: quantise
        rmsnorm(x + residual) * w, writing x + residual to residual when HAS_RESIDUAL."""
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        ok = offs < n
        dtype = x_ptr.dtype.element_ty
        x = tl.load(x_ptr + row * stride + offs, mask=ok, other=0.0).to(tl.float32)
        if MODE == 1:
            up = tl.load(x_ptr + row * stride + n + offs, mask=ok, other=0.0).to(tl.float32)
            x = (x / (1.0 + tl.exp(-x)) * up).to(dtype).to(tl.float32)
        if MODE == 2:
            if HAS_RESIDUAL:
                x = (x + tl.load(r_ptr + row * r_stride + offs, mask=ok, other=0.0).to(tl.float32)).to(dtype)
                tl.store(r_ptr + row * r_stride + offs, x, mask=ok)
                x = x.to(tl.float32)
            rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n + eps)
            w = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
            x = ((x * rstd).to(dtype).to(tl.float32) * w).to(dtype).to(tl.float32)
        s = tl.maximum(tl.max(tl.abs(x), axis=0), 1e-12) / 448.0
        y = tl.minimum(tl.maximum(x / s, -448.0), 448.0)
        tl.store(q_ptr + row * n + offs, y.to(q_ptr.dtype.element_ty), mask=ok)
        tl.store(s_ptr + row, s)

    def launch(x: torch.Tensor, n: int, mode: int, residual=None, weight=None, eps: float = 0.0) -> Fp8Activations:
        t = x.shape[0]
        if x.stride(-1) != 1 or (residual is not None and residual.stride(-1) != 1):
            raise ValueError("the fused quantisers need rows of unit column stride")
        q = torch.empty((t, n), dtype=FP8, device=x.device)
        s = torch.empty((t, 1), dtype=torch.float32, device=x.device)
        if t:
            block = triton.next_power_of_2(n)
            fused_fp8_quantise[(t,)](x, residual if residual is not None else x, weight if weight is not None else x, q,
                                     s, n, x.stride(0), residual.stride(0) if residual is not None else 0, eps,
                                     BLOCK=block, MODE=mode, HAS_RESIDUAL=residual is not None,
                                     num_warps=16 if block >= 16384 else (8 if block >= 4096 else 4))
        return Fp8Activations(q, s)

    return FusedQuantisers(
        quant=lambda x: launch(x, x.shape[1], 0),
        silu_mul_quant=lambda gu: launch(gu, gu.shape[1] // 2, 1),
        add_norm_quant=lambda x, residual, weight, eps: launch(x, x.shape[1], 2, residual, weight, eps))


def fused_quantisers(x: torch.Tensor) -> Optional[FusedQuantisers]:
    """The Triton quantisers for activations like x, or None (CPU, no Triton, not 2-D with unit column stride, not
    bf16/fp16): the caller then computes the activation and quantises it with quantize_rows. (Under tensor
    parallelism with the all-reduce fusion, decode batches' norms run inside the all-reduce kernel instead, and the
    qkv and gate/up inputs take `quant` after it.)"""
    if x.is_cuda and x.dim() == 2 and x.stride(-1) == 1 and x.dtype in (torch.bfloat16, torch.float16):
        return triton_quantisers()
    return None


def quantize_tokens(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Activations [T, K] -> (float8 [T, K], float32 [T, 1]): one Triton kernel on CUDA, else quantize_rows."""
    if x.is_cuda and x.stride(-1) == 1:
        fused = triton_quantisers()
        if fused is not None:
            return tuple(fused.quant(x))
    return quantize_rows(x)
