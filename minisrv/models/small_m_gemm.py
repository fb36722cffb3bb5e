"""A GEMM for few rows (decode batches): y = x W^T in bf16, for x [m <= SMALL_M, K] and W [N, K], on CUDA (Triton).

Why: at decode a projection reads its whole weight matrix for a handful of tokens, so the product is a matter of
reading W at the memory bandwidth. cuBLAS tiles the output 64-128 columns at a time, so a 4096-wide projection (or a
tensor-parallel rank's half of one) runs on a few dozen of the GPU's 132 SMs and reads its weights at half the
bandwidth. Here each program owns 16-64 output columns and all of the rows, so every SM streams a share of W.

Three operand kinds, one kernel:
- "fp8":   x and W in float8_e4m3fn, x scaled per row (xs [m, 1]), W per output column (ws [1, N]): the same
           operands and product as `torch._scaled_mm`'s row-wise mode (W8A8).
- "w8a16": x in bf16, W in float8_e4m3fn with ws [1, N]: W widened to bf16 in registers, x used as it is (no
           rounding of the activations, and no quantising kernel before the GEMM). With `fp16_math`, W is widened
           to float16 instead (every e4m3 value is a float16 one; the GPU converts e4m3 pairs to float16 in one
           instruction, to bf16 only through float32) and x is rounded to float16 (3 more mantissa bits than
           bf16; magnitudes beyond float16's 65504 are clamped).
- "bf16":  x and W in bf16: what `F.linear` computes.
Every kind accumulates in float32. Launch parameters come from `default_config` (scripts/bench_small_m_gemm.py's
sweep on an H100) unless given; K must be a multiple of the chosen K step (`fits`).
"""
from __future__ import annotations

import functools
import logging
from typing import Callable, NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

SMALL_M = 64  # token counts up to this (decode batches) take this kernel
MIN_BLOCK_K = 128  # every configuration's K step is a multiple of this: K must be too
KINDS = ("fp8", "w8a16", "bf16")


class SmallMConfig(NamedTuple):
    """Launch parameters (scripts/bench_small_m_gemm.py sweeps them)."""

    block_n: int  # output columns a program owns
    block_k: int  # the reduction's step; the input width must be a multiple of it
    num_warps: int
    num_stages: int
    fp16_math: bool = False  # w8a16 only: widen W to float16 (one conversion from e4m3) and round x to float16


def kind_of(x: torch.Tensor, w: torch.Tensor) -> str:
    """The operand kind ("fp8", "w8a16", "bf16") of x and W, or ValueError for a pair the kernel does not take."""
    fp8 = torch.float8_e4m3fn
    if x.dtype == fp8 and w.dtype == fp8:
        return "fp8"
    if x.dtype == torch.bfloat16 and w.dtype == fp8:
        return "w8a16"
    if x.dtype == torch.bfloat16 and w.dtype == torch.bfloat16:
        return "bf16"
    raise ValueError(f"no small-batch GEMM for x {x.dtype} and W {w.dtype}")


def default_config(kind: str, n: int, k: int, m: int) -> SmallMConfig:
    """Launch parameters for an [m, k] x [n, k]^T product of the given kind.

    FP8 weights (from the H100 sweep of Llama-3-8B's projections at m = 1, 16, 64): narrow outputs want 16-column
    programs, K steps of 256 and two warps for a few rows (four for more), and deeper pipelines for long reductions;
    the 4096 x 14336 down projection went from 35 to 25 us, the 4096 x 4096 o projection from 9.8 to 7.3 us at
    m = 1. Wide outputs (> 8192 columns) already have enough programs and keep 32 columns and K steps of 128.
    bf16 weights take the same shape of tile in bytes: half the K step."""
    if n > 8192 or k % 256:
        c = SmallMConfig(32 if n > 8192 else 16, 128, 4, 3 if n > 8192 else 4)
    else:
        stages = 5 if k > 8192 else (3 if m <= 16 else 4)
        c = SmallMConfig(16, 256, 2, stages) if m <= 16 else SmallMConfig(32, 256, 4, stages)
    if kind == "bf16":
        c = c._replace(block_k=max(MIN_BLOCK_K // 2, c.block_k // 2))
    return c


def fits(k: int) -> bool:
    """Whether an input width K can take the kernel (every default K step divides it)."""
    return k % MIN_BLOCK_K == 0


@functools.lru_cache(maxsize=None)
def small_m_gemm() -> Optional[Callable[..., Optional[torch.Tensor]]]:
    """The kernel's launcher `run(x, w, xs=None, ws=None, config=None, raise_errors=False)`, or None where Triton
    is missing. `run` returns None (and keeps returning None, so callers use cuBLAS) if the kernel cannot compile
    here, unless raise_errors (a sweep's configurations that do not fit are its own business)."""
    try:
        import triton
        import triton.language as tl
    except Exception:  # noqa: BLE001 - any import failure means "not present"
        return None

    @triton.jit
    def kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, y_ptr, m, n, k, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr, X_SCALED: tl.constexpr, W_SCALED: tl.constexpr, WIDEN_W: tl.constexpr,
               F16_MATH: tl.constexpr):
        pid = tl.program_id(0)
        rows = tl.arange(0, BLOCK_M)
        cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        ks = tl.arange(0, BLOCK_K)
        x_ptrs = x_ptr + rows[:, None] * k + ks[None, :]
        w_ptrs = w_ptr + cols[:, None] * k + ks[None, :]
        row_ok = rows[:, None] < m
        col_ok = cols[:, None] < n
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for _ in range(0, k, BLOCK_K):  # k is a multiple of BLOCK_K (checked by the launcher)
            x = tl.load(x_ptrs, mask=row_ok, other=0.0)
            w = tl.load(w_ptrs, mask=col_ok, other=0.0)
            if F16_MATH:
                x = tl.minimum(tl.maximum(x.to(tl.float32), -65504.0), 65504.0).to(tl.float16)
                w = w.to(tl.float16)
            elif WIDEN_W:
                w = w.to(tl.bfloat16)
            acc = tl.dot(x, tl.trans(w), acc)
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        if X_SCALED:
            acc = acc * tl.load(xs_ptr + rows, mask=rows < m, other=0.0)[:, None]
        if W_SCALED:
            acc = acc * tl.load(ws_ptr + cols, mask=cols < n, other=0.0)[None, :]
        tl.store(y_ptr + rows[:, None] * n + cols[None, :], acc.to(tl.bfloat16), mask=row_ok & (cols[None, :] < n))

    broken: list = []  # a compile failure turns the kernel off for good

    def run(x: torch.Tensor, w: torch.Tensor, xs: Optional[torch.Tensor] = None, ws: Optional[torch.Tensor] = None,
            config: Optional[SmallMConfig] = None, raise_errors: bool = False) -> Optional[torch.Tensor]:
        if broken and not raise_errors:
            return None
        kind = kind_of(x, w)
        m, k = x.shape
        n = w.shape[0]
        c = config or default_config(kind, n, k, m)
        if k % c.block_k or (kind != "bf16") != (ws is not None) or (kind == "fp8") != (xs is not None):
            raise ValueError(f"{kind} GEMM of K={k}: K step {c.block_k}, x scale {xs is not None}, "
                             f"W scale {ws is not None}")
        y = torch.empty((m, n), dtype=torch.bfloat16, device=x.device)
        try:
            kernel[(triton.cdiv(n, c.block_n),)](
                x, xs if xs is not None else x, w, ws if ws is not None else w, y, m, n, k,
                BLOCK_M=max(16, triton.next_power_of_2(m)), BLOCK_N=c.block_n, BLOCK_K=c.block_k,
                X_SCALED=xs is not None, W_SCALED=ws is not None, WIDEN_W=kind == "w8a16",
                F16_MATH=kind == "w8a16" and c.fp16_math,
                num_warps=c.num_warps, num_stages=c.num_stages)
        except Exception as e:  # noqa: BLE001 - e.g. a Triton without FP8 dot support on this GPU
            if raise_errors:
                raise
            logging.getLogger("minisrv").warning("small-batch GEMM unavailable (%s: %s); using cuBLAS",
                                                 type(e).__name__, e)
            broken.append(e)
            return None
        return y

    return run


class SmallBatchLinear(nn.Linear):
    """nn.Linear whose decode batches (at most SMALL_M rows, bf16 on CUDA, K a multiple of MIN_BLOCK_K) take the
    small-batch kernel; everything else (prefill, the CPU, other dtypes) F.linear. The parameters are nn.Linear's:
    `use_for_projections` turns a built model's projections into these in place."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        if (x2.is_cuda and x2.dtype == torch.bfloat16 and self.weight.dtype == torch.bfloat16
                and 0 < x2.shape[0] <= SMALL_M and fits(self.in_features)):
            run = small_m_gemm()
            out = run(x2.contiguous(), self.weight) if run is not None else None
            if out is not None:
                if self.bias is not None:
                    out = out + self.bias
                return out.reshape(*x.shape[:-1], self.out_features)
        return F.linear(x, self.weight, self.bias)


def use_for_projections(model: nn.Module, names: Tuple[str, ...]) -> int:
    """Make the model's nn.Linear children called `names` SmallBatchLinear (same parameters, new forward).
    Returns how many changed."""
    count = 0
    for module in model.modules():
        for name in names:
            child = getattr(module, name, None)
            if type(child) is nn.Linear:
                child.__class__ = SmallBatchLinear
                count += 1
    return count
