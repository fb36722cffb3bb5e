"""A decode step's few (token, expert) pairs against MXFP4 experts (gpt-oss: kernels/moe_w4a16.py's Mxfp4Experts
layout, rows of [N, K] with K packed two values a byte and one e8m0 exponent per 32), one pair a program row.

Why: with a handful of pairs the grouped GEMM (moe_gemm.py) pads each expert's pairs to a 16-row block and sends
the dequantised tile through shared memory to the tensor cores: the cost of a whole block for one or two rows. Here
each program takes block_n of its expert's rows, reads their bytes along K (contiguous in the layout), decodes both
nibbles of a byte on the CUDA cores, multiplies by the pair's activation row and sums each 32 values before their
scale; the bias is added in float32, and the result rounds once to the activation's dtype. The small steps around
the two products run in their epilogues, since at decode each would be a launch of its own for a few kilobytes: the
gate/up product's activation (a program takes gate rows and the matching up rows) and the down product's routing
weight (the sum over a token's k pairs is left to the caller).

A nibble (sign, two exponent bits, one mantissa bit) is read as float32 by moving its bits, not by branching: the
sign to bit 31 and the three others to bits 22-24 (the exponent's two lowest bits and the mantissa's top bit) read as
the e2m1 value times 2^-126, exactly (e = 0, the value 0.5, lands on float32's subnormal 2^-127, which the GPU's
float32 arithmetic keeps). The activation is multiplied by 2^100 so that these products stay normal floats, and each
32 values' sum by 2^(s - 127) * 2^26 (the exponent byte s as s << 23) to undo both."""
from __future__ import annotations

from types import ModuleType
from typing import Callable, NamedTuple, Optional

import torch

from minisrv.kernels.moe_gemm import ClampedSwiGLU
from minisrv.kernels.triton_launcher import triton_launcher


class PairConfig(NamedTuple):
    """Launch parameters: a program's weight rows (gated: half gate rows, half the matching up rows), its K step (a
    multiple of 32), its warps."""

    block_n: int = 32
    block_k: int = 512
    num_warps: int = 4


@triton_launcher
def mxfp4_pair_gemv(triton: ModuleType, tl: ModuleType) -> Callable[..., torch.Tensor]:
    """The launcher `run(x, blocks, scales, ids, rows_per_x, bias=None, config=PairConfig(), gated=False,
    swiglu=None, row_weights=None)`: x [R / rows_per_x, K] (pair r reads row r // rows_per_x), blocks uint8 [E, N,
    K/2], scales uint8 [E, N, K/32], ids int32 [R] (pair r's expert), bias [E, N] or None -> [R, N] in x's dtype.
    gated: the N rows are gate rows then up rows, and the output [R, N/2] is their activation (silu(gate) * up, or
    `swiglu`'s), each product rounded to x's dtype first; row_weights float32 [R]: each output row rounded to x's
    dtype and then times its weight (the pair's routing weight). None where Triton is missing."""

    @triton.jit
    def pair_gemv(x_ptr, stride_x, blocks_ptr, scales_ptr, ids_ptr, bias_ptr, weights_ptr, out_ptr, N, K, alpha,
                  limit, ROWS_PER_X: tl.constexpr, HAS_BIAS: tl.constexpr, GATED: tl.constexpr,
                  CLAMPED: tl.constexpr, ROW_WEIGHTS: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        r = tl.program_id(0)
        n = tl.program_id(1) * BN + tl.arange(0, BN)  # output columns
        n_ok = n < N
        expert = tl.load(ids_ptr + r).to(tl.int64)
        x_row = x_ptr + (r // ROWS_PER_X).to(tl.int64) * stride_x
        if GATED:  # gate row n, then its up row N + n
            base = expert * 2 * N + n.to(tl.int64)
            rows = tl.reshape(tl.join(base, base + N), [2 * BN])
            ok = tl.reshape(tl.join(n_ok, n_ok), [2 * BN])
        else:
            rows, ok = expert * N + n.to(tl.int64), n_ok
        RB: tl.constexpr = 2 * BN if GATED else BN
        j = tl.arange(0, BK // 2)
        g = tl.arange(0, BK // 32)
        acc = tl.zeros([RB], dtype=tl.float32)
        X_UP: tl.constexpr = 1.2676506002282294e30  # 2^100: the activation's factor (see the module docstring)
        for k0 in range(0, K, BK):
            in_k = k0 + 2 * j < K
            b = tl.load(blocks_ptr + rows[:, None] * (K // 2) + k0 // 2 + j[None, :],
                        mask=ok[:, None] & in_k[None, :], other=0).to(tl.int32)
            # byte i holds values k0 + 2i (low nibble) and k0 + 2i + 1 (high nibble), each taken times 2^-126
            even = (((b << 22) & 0x01C00000) | ((b << 28) & -0x80000000)).to(tl.float32, bitcast=True)
            odd = (((b << 18) & 0x01C00000) | ((b << 24) & -0x80000000)).to(tl.float32, bitcast=True)
            x_even = tl.load(x_row + k0 + 2 * j, mask=in_k, other=0.0).to(tl.float32) * X_UP
            x_odd = tl.load(x_row + k0 + 2 * j + 1, mask=in_k, other=0.0).to(tl.float32) * X_UP
            prod = even * x_even[None, :] + odd * x_odd[None, :]
            sums = tl.sum(tl.reshape(prod, [RB, BK // 32, 16]), axis=2)  # each 32 values of K
            s = tl.load(scales_ptr + rows[:, None] * (K // 32) + k0 // 32 + g[None, :],
                        mask=ok[:, None] & (k0 + 32 * g < K)[None, :], other=0).to(tl.int32)
            acc += tl.sum(sums * (s << 23).to(tl.float32, bitcast=True), axis=1) * 67108864.0  # 2^26: 2^126 / X_UP
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rows, mask=ok, other=0.0).to(tl.float32)
        dtype = out_ptr.dtype.element_ty
        if GATED:
            gate, up = tl.split(tl.reshape(acc.to(dtype).to(tl.float32), [BN, 2]))
            if CLAMPED:
                gate = tl.minimum(gate, limit)
                y = gate * tl.sigmoid(gate * alpha) * (tl.minimum(tl.maximum(up, -limit), limit) + 1.0)
            else:
                y = gate * tl.sigmoid(gate) * up
        else:
            y = acc
        if ROW_WEIGHTS:
            y = y.to(dtype).to(tl.float32) * tl.load(weights_ptr + r)
        tl.store(out_ptr + r.to(tl.int64) * N + n, y.to(dtype), mask=n_ok)

    def run(x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor, ids: torch.Tensor, rows_per_x: int,
            bias: Optional[torch.Tensor] = None, config: PairConfig = PairConfig(), gated: bool = False,
            swiglu: Optional[ClampedSwiGLU] = None, row_weights: Optional[torch.Tensor] = None) -> torch.Tensor:
        _, n, half_k = blocks.shape
        k = 2 * half_k
        if x.shape[1] != k or x.stride(1) != 1 or k % 32 or ids.dtype != torch.int32 or (gated and n % 2):
            raise ValueError(f"MXFP4 pairs: x {tuple(x.shape)} stride {x.stride()}, blocks {tuple(blocks.shape)}, "
                             f"ids {ids.dtype}")
        n_out, block_n = (n // 2, config.block_n // 2) if gated else (n, config.block_n)
        out = torch.empty(ids.shape[0], n_out, dtype=x.dtype, device=x.device)
        if ids.shape[0]:
            pair_gemv[(ids.shape[0], triton.cdiv(n_out, block_n))](
                x, x.stride(0), blocks, scales, ids, bias if bias is not None else x,
                row_weights if row_weights is not None else x, out, n_out, k,
                swiglu.alpha if swiglu else 1.0, swiglu.limit if swiglu else 0.0, ROWS_PER_X=rows_per_x,
                HAS_BIAS=bias is not None, GATED=gated, CLAMPED=swiglu is not None,
                ROW_WEIGHTS=row_weights is not None, BN=block_n, BK=config.block_k,
                num_warps=config.num_warps)
        return out

    return run
