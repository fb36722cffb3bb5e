"""The FP8 (W8A8) GEMM for few rows: y = (xq * xs) (wq * ws)^T in bf16, for decode batches of m <= SMALL_M tokens.
Operands as `torch._scaled_mm`'s row-wise mode takes them: xq [m, K] and wq [N, K] in float8_e4m3fn, xs [m, 1] a
scale per token, ws [1, N] a scale per output column; float32 accumulation.

Why: at decode a projection reads its whole weight for a handful of tokens, so the product runs at the speed W is
read. cuBLAS tiles the output 128 columns at a time, so a 4096-wide projection runs on 32 of an H100's 132 SMs. Here a
program owns 16-128 output columns and all the rows (padded to 16 for the tensor-core dot), so every SM streams a
share of W (the end-to-end gain: docs/kernels.md).
"""
from __future__ import annotations

import logging
from types import ModuleType
from typing import Callable, NamedTuple, Optional

import torch

from minisrv.kernels.triton_launcher import triton_launcher

SMALL_M = 64  # token counts up to this (decode batches) take the kernel; more go to torch._scaled_mm
MIN_BLOCK_K = 128  # every configuration's K step is a multiple of this: K must be too


class GemmConfig(NamedTuple):
    """Launch parameters."""

    block_n: int  # output columns a program owns
    block_k: int  # the reduction's step; K must be a multiple of it
    num_warps: int
    num_stages: int


def fits(k: int) -> bool:
    """Whether an input width K can take the kernel (every K step of `config_for` divides it)."""
    return k % MIN_BLOCK_K == 0


def config_for(n: int, k: int, m: int) -> GemmConfig:
    """Launch parameters for an [m, k] x [n, k]^T product, from H100 sweeps of Llama-3-8B's projections ([N, K]:
    qkv 6144 x 4096, o 4096 x 4096, gate_up 28672 x 4096, down 4096 x 14336) at m = 1, 16, 32, 64 (in us).

    Few rows (m <= 16): 16-column programs, K steps of 256, two warps, deeper pipelines for long reductions (down
    35.8 -> 24.7, o 9.8 -> 7.3, qkv 12.5 -> 9.2 at m = 1 against the first single setting). More rows: 32 columns
    and four warps, except 17-32 rows of outputs wider than 4096 or of long reductions, which keep 16 columns
    (qkv 14.3 -> 13.4, down 31.5 -> 28.7 at m = 32). Wide outputs (> 8192 columns) have programs enough: 32 columns
    and K steps of 128, and from 33 rows, where 128-column programs are still 128 or more, 128 columns and 8 warps
    (gate_up 52.4 -> 45.3 at m = 64; torch._scaled_mm 51.4).
    """
    wide = n > 8192
    if wide or k % 256:
        if n >= 16384 and m > 32:
            return GemmConfig(128, 128, 8, 3)
        return GemmConfig(32 if wide else 16, 128, 4, 3 if wide else 4)
    long_k = k > 8192
    if m <= 16:
        return GemmConfig(16, 256, 2, 5 if long_k else 3)
    if m <= 32 and (long_k or n > 4096):
        return GemmConfig(16, 256, 4, 4 if long_k else 3)
    return GemmConfig(32, 256, 4, 5 if long_k else 4)


def dequantized_matmul(xq: torch.Tensor, xs: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor,
                       dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The product the kernel computes, in torch: the operands dequantised and multiplied in `dtype` (the reference
    of the kernel, in float64, and FP8 layers' product off CUDA, in float32)."""
    return (xq.to(dtype) * xs.to(dtype)) @ (wq.to(dtype) * ws.reshape(-1, 1).to(dtype)).t()


@triton_launcher
def small_m_fp8_gemm(triton: ModuleType, tl: ModuleType) -> Callable[..., Optional[torch.Tensor]]:
    """The launcher `run(xq, xs, wq, ws, config=None, raise_errors=False)` -> y [m, N] bf16, or None where Triton is
    missing. `run` returns None (and keeps returning None, so that callers use torch._scaled_mm) if the kernel cannot
    compile here, e.g. a Triton without FP8 dots for this GPU, unless raise_errors."""

    @triton.jit
    def small_m_fp8_gemm(x_ptr, xs_ptr, w_ptr, ws_ptr, y_ptr, m, n, k, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr):
        """Program pid owns output columns [pid * BLOCK_N, +BLOCK_N) for all m rows."""
        pid = tl.program_id(0)
        rows = tl.arange(0, BLOCK_M)
        cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        ks = tl.arange(0, BLOCK_K)
        x_ptrs = x_ptr + rows[:, None] * k + ks[None, :]
        w_ptrs = w_ptr + cols[:, None] * k + ks[None, :]
        row_ok = rows[:, None] < m
        col_ok = cols[:, None] < n
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for _ in range(0, k, BLOCK_K):
            x = tl.load(x_ptrs, mask=row_ok, other=0.0)
            w = tl.load(w_ptrs, mask=col_ok, other=0.0)
            acc = tl.dot(x, tl.trans(w), acc)
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        acc = acc * tl.load(xs_ptr + rows, mask=rows < m, other=0.0)[:, None]
        acc = acc * tl.load(ws_ptr + cols, mask=cols < n, other=0.0)[None, :]
        tl.store(y_ptr + rows[:, None] * n + cols[None, :], acc.to(tl.bfloat16), mask=row_ok & (cols[None, :] < n))

    broken: list = []  # the error that turned the kernel off for good, once there is one

    def run(xq: torch.Tensor, xs: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor,
            config: Optional[GemmConfig] = None, raise_errors: bool = False) -> Optional[torch.Tensor]:
        if broken and not raise_errors:
            return None
        m, k = xq.shape
        n = wq.shape[0]
        c = config or config_for(n, k, m)
        if k % c.block_k or not (xq.is_contiguous() and wq.is_contiguous()):
            raise ValueError(f"FP8 GEMM of K={k}: K step {c.block_k}, operands contiguous "
                             f"{xq.is_contiguous()}, {wq.is_contiguous()}")
        y = torch.empty((m, n), dtype=torch.bfloat16, device=xq.device)
        try:
            small_m_fp8_gemm[(triton.cdiv(n, c.block_n),)](
                xq, xs, wq, ws, y, m, n, k, BLOCK_M=max(16, triton.next_power_of_2(m)), BLOCK_N=c.block_n,
                BLOCK_K=c.block_k, num_warps=c.num_warps, num_stages=c.num_stages)
        except Exception as e:  # noqa: BLE001 - e.g. a Triton without FP8 dot support on this GPU
            if raise_errors:
                raise
            logging.getLogger("minisrv").warning("small-batch FP8 GEMM unavailable (%s: %s); using "
                                                 "torch._scaled_mm", type(e).__name__, e)
            broken.append(e)
            return None
        return y

    return run
