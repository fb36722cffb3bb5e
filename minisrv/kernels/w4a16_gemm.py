"""The W4A16 GEMM: y = x W for activations x [M, K] in bf16/fp16/fp32 and a 4-bit weight W [K, N] held in the
layout every 4-bit checkpoint format is repacked into at load (checkpoints/int4_formats.py):

- qweight int32 [K/8, N]: row k of W is nibble k % 8 (bits 4 * (k % 8)) of word [k // 8, n], values 0..15;
- scales [K/G, N] (float16 or bfloat16) and zeros uint8 [K/G, N]: W[k, n] = (q - zeros[k // G, n]) * scales[k // G, n]
  for groups of G consecutive rows of K (G = K: one scale per output column). Symmetric formats have zeros 8.

Packing along K keeps a program's loads contiguous along N (its output columns), and a K step of the kernel
(BLOCK_K rows, BLOCK_K dividing G) falls inside one group, so it reads one row of scales and zeros.

One Triton kernel serves every batch: each program dequantises a [BLOCK_K, BLOCK_N] tile in registers (never a
bf16 weight in memory) and feeds it to tl.dot (tensor cores). Decode batches (M <= SPLIT_M) have too few output
tiles to occupy the GPU, so the K loop is split over programs whose float32 partial sums are added afterwards
(deterministic, no atomics, capturable in CUDA graphs); prefill batches tile M and N with one program a tile.
Off CUDA (and as the tests' reference) the same arithmetic runs in torch: `dequantize` then a matmul.
"""
from __future__ import annotations

from types import ModuleType
from typing import Callable, NamedTuple, Optional

import torch

from minisrv.kernels.triton_launcher import triton_launcher

SPLIT_M = 64  # batches up to this many rows split K over programs
TARGET_PROGRAMS = 264  # split-K aims at this many programs (two per SM of an H100)


class W4A16Config(NamedTuple):
    """Launch parameters."""

    block_m: int
    block_n: int
    block_k: int  # must divide the group size
    split_k: int  # programs sharing one output tile's K loop (1: none)
    num_warps: int
    num_stages: int


def unpack_rows(qweight: torch.Tensor) -> torch.Tensor:
    """The 4-bit values of qweight [K/8, N] as uint8 [K, N] (row 8i + j: nibble j of row i's words)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=qweight.device)
    values = (qweight.unsqueeze(1) >> shifts[None, :, None]) & 0xF  # [K/8, 8, N]
    return values.reshape(-1, qweight.shape[1]).to(torch.uint8)


def pack_rows(values: torch.Tensor) -> torch.Tensor:
    """uint8 values 0..15 [K, N] (K a multiple of 8) packed into int32 [K/8, N]: the inverse of `unpack_rows`."""
    v = values.to(torch.int32).reshape(-1, 8, values.shape[1])
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=values.device)
    # nibble 7 reaches the sign bit: the sum of the shifted nibbles wraps as the bit pattern it stands for
    return (v << shifts[None, :, None]).sum(dim=1, dtype=torch.int32)


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """W [K, N] in `dtype`: (q - zero) * scale of each element's group (the group size is K / scales' rows)."""
    q = unpack_rows(qweight)
    group = q.shape[0] // scales.shape[0]
    z = zeros.to(dtype).repeat_interleave(group, dim=0)
    s = scales.to(dtype).repeat_interleave(group, dim=0)
    return (q.to(dtype) - z) * s


def dequantized_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                       zeros: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ W in x's dtype, W dequantised in float32 and rounded to x's dtype as the kernel's tile is (the
    CPU's path, and the GPU's where Triton is missing)."""
    return x @ dequantize(qweight, scales, zeros).to(x.dtype)


def config_for(m: int, n: int, k: int, group: int) -> W4A16Config:
    """Launch parameters for [m, k] x [k, n] with groups of `group` rows. One row: 128 columns a program on the
    CUDA cores, K in 8 shares; up to 16 rows: 16-row tiles of 64 columns, K in 8 shares; up to 64: 32-64-row tiles
    of 64 columns, K split until about TARGET_PROGRAMS programs run; larger batches: 64 or 128-row tiles of 128
    columns, K steps of 64, no split."""
    if m <= SPLIT_M:
        block_m = 1 if m == 1 else 16 if m <= 16 else 32 if m <= 32 else 64
        block_n, block_k, warps = (128 if m == 1 else 64), 128, 4
    else:
        block_m, block_n, block_k = (64 if m <= 128 else 128), 128, 64
        warps = 4 if block_m == 64 else 8
    while group % block_k:
        block_k //= 2
    if block_k < 16:
        raise ValueError(f"4-bit group of {group} rows: the kernel needs groups of a multiple of 16")
    tiles = -(-m // block_m) * -(-n // block_n)
    k_steps = k // block_k
    split = max(1, min(k_steps, TARGET_PROGRAMS // tiles)) if m <= SPLIT_M else 1
    if m <= 16:  # one row, or a few: K in 8 shares (more programs in flight; H100, the 8B shape's projections)
        split = min(k_steps, 8)
    return W4A16Config(block_m, block_n, block_k, split, warps, 3)


@triton_launcher
def w4a16_gemm(triton: ModuleType, tl: ModuleType) -> Callable[..., torch.Tensor]:
    """The launcher `run(x, qweight, scales, zeros, config=None)` -> y [M, N] in x's dtype, or None where Triton
    is missing."""

    @triton.jit
    def w4a16_gemm_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, y_ptr, m, n, k, group, steps_per_split, stride_xm,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr):
        """Program (pid_m, pid_n, pid_k): output tile (pid_m, pid_n) over K steps [pid_k * steps_per_split, +
        steps_per_split). SPLIT > 1: y_ptr is float32 [SPLIT, m, n] partial sums, else y [m, n]."""
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        pid_k = tl.program_id(2)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        ks = tl.arange(0, BLOCK_K)
        kw = tl.arange(0, BLOCK_K // 8)
        row_ok = rows < m
        col_ok = cols < n
        shifts = (tl.arange(0, 8) * 4)[None, :, None]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        first = pid_k * steps_per_split
        last = tl.minimum(first + steps_per_split, k // BLOCK_K)
        for step in range(first, last):
            k0 = step * BLOCK_K
            x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + (k0 + ks)[None, :], mask=row_ok[:, None],
                        other=0.0)
            # each word once: [BLOCK_K / 8, BLOCK_N] words, their 8 nibbles each then laid out as 8 rows of K
            words = tl.load(qw_ptr + (k0 // 8 + kw)[:, None].to(tl.int64) * n + cols[None, :],
                            mask=col_ok[None, :], other=0)
            q = tl.reshape((words[:, None, :] >> shifts) & 0xF, (BLOCK_K, BLOCK_N))
            g = k0 // group
            scale = tl.load(s_ptr + g * n + cols, mask=col_ok, other=0.0).to(tl.float32)
            zero = tl.load(z_ptr + g * n + cols, mask=col_ok, other=0).to(tl.int32)
            w = ((q - zero[None, :]).to(tl.float32) * scale[None, :]).to(x.dtype)
            if BLOCK_M >= 16:
                acc = tl.dot(x, w, acc)
            else:  # a row or a few (tl.dot takes 16 or more): products summed over K on the CUDA cores
                acc += tl.sum(x.to(tl.float32)[:, :, None] * w.to(tl.float32)[None, :, :], axis=1)
        out = rows[:, None].to(tl.int64) * n + cols[None, :]
        mask = row_ok[:, None] & col_ok[None, :]
        if SPLIT > 1:
            tl.store(y_ptr + pid_k.to(tl.int64) * m * n + out, acc, mask=mask)
        else:
            tl.store(y_ptr + out, acc.to(y_ptr.dtype.element_ty), mask=mask)

    def run(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
            config: Optional[W4A16Config] = None) -> torch.Tensor:
        m, k = x.shape
        n = qweight.shape[1]
        group = k // scales.shape[0]
        c = config or config_for(m, n, k, group)
        if (qweight.shape[0] * 8 != k or group % c.block_k or x.stride(1) != 1
                or not (qweight.is_contiguous() and scales.is_contiguous() and zeros.is_contiguous())):
            raise ValueError(f"W4A16 GEMM operands: x {tuple(x.shape)} (column stride {x.stride(1)}), qweight "
                             f"{tuple(qweight.shape)}, scales {tuple(scales.shape)}, K step {c.block_k}")
        steps = k // c.block_k
        per_split = -(-steps // c.split_k)
        split = -(-steps // per_split)
        if split > 1:
            y = torch.empty((split, m, n), dtype=torch.float32, device=x.device)
        else:
            y = torch.empty((m, n), dtype=x.dtype, device=x.device)
        grid = (triton.cdiv(m, c.block_m), triton.cdiv(n, c.block_n), split)
        w4a16_gemm_kernel[grid](x, qweight, scales, zeros, y, m, n, k, group, per_split, x.stride(0),
                                BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k, SPLIT=split,
                                num_warps=c.num_warps, num_stages=c.num_stages)
        return y.sum(dim=0).to(x.dtype) if split > 1 else y

    return run
