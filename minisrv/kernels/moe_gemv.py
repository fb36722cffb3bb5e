"""The experts for a few tokens (decode at small batch) as matrix-vector products, one pair or one token a program,
with no alignment and no separate sum over k.

At batch 1 the grouped GEMM path (moe_align.py + moe_gemm.py) spends a launch aligning 8 pairs, pads each to a
16-row block (tensor-core tiles for one row), and sums the k outputs in another launch. Here:
- gate/up: program (pair p, column tile) reads expert e(p)'s gate and up rows of the tile and the token's row of
  x, and writes silu(gate) * up for the pair;
- down: program (token t, column tile) walks the token's k pairs, multiplying expert e's down rows of the tile by
  the pair's activations scaled by its routing weight, and writes the sum over k: the final output row.
Each weight byte a pair needs is read once per pair: the same bytes as the grouped path while no two of the step's
tokens share an expert, more where they do, so this path is taken up to GEMV_TOKENS tokens (fused_moe.py).
FP8 (W8A8, as the grouped path): the activations quantised per token before each product, the weight rows scaled
per output row.
"""
from __future__ import annotations

import functools
from typing import Callable, Optional

import torch


@functools.lru_cache(maxsize=None)
def moe_gemv() -> Optional[Callable[..., None]]:
    """The launcher `run(a, a_scale, b, b_scale, out, ids, weights, gate_up, block_n, block_k)` (see run), or None
    where Triton is missing."""
    try:
        import triton
        import triton.language as tl
    except Exception:  # noqa: BLE001 - any import failure means "not present"
        return None

    @triton.jit
    def kernel(a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, out_ptr, ids_ptr, weights_ptr, n, k, stride_am, stride_be,
               stride_bn, stride_se, stride_om, TOP_K: tl.constexpr, GATE_UP: tl.constexpr, FP8: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """GATE_UP: program (pair, tile), A's row = the pair's token, B = w13 (gate rows [0, n), up rows [n, 2n)).
        Otherwise: program (token, tile), looping over the token's TOP_K pairs (A's rows), B = w2; the k products
        summed with the routing weights folded into A's values (and, for FP8, the scales into both operands)."""
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < n
        ks = tl.arange(0, BLOCK_K)
        steps = tl.cdiv(k, BLOCK_K)
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        if GATE_UP:
            expert = tl.load(ids_ptr + row).to(tl.int64)
            a_row = a_ptr + (row // TOP_K).to(tl.int64) * stride_am
            b_rows = b_ptr + expert * stride_be + cols[:, None].to(tl.int64) * stride_bn
            up = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
            for step in range(0, steps):
                k0 = step * BLOCK_K
                k_ok = ks < k - k0
                x = tl.load(a_row + k0 + ks, mask=k_ok, other=0.0).to(tl.float32)[None, :]
                mask = col_ok[:, None] & k_ok[None, :]
                acc += tl.load(b_rows + k0 + ks[None, :], mask=mask, other=0.0).to(tl.float32) * x
                up += tl.load(b_rows + n * stride_bn + k0 + ks[None, :], mask=mask, other=0.0).to(tl.float32) * x
            gate = tl.sum(acc, axis=1)
            up_sum = tl.sum(up, axis=1)
            if FP8:
                a_scale = tl.load(a_scale_ptr + row // TOP_K)
                scales = b_scale_ptr + expert * stride_se + cols
                gate = gate * a_scale * tl.load(scales, mask=col_ok, other=0.0)
                up_sum = up_sum * a_scale * tl.load(scales + n, mask=col_ok, other=0.0)
            result = gate / (1.0 + tl.exp(-gate)) * up_sum
        else:
            for it in range(0, TOP_K * steps):
                pair = row * TOP_K + it // steps
                k0 = (it % steps) * BLOCK_K
                k_ok = ks < k - k0
                expert = tl.load(ids_ptr + pair).to(tl.int64)
                coef = tl.load(weights_ptr + pair)
                if FP8:
                    coef = coef * tl.load(a_scale_ptr + pair)
                x = tl.load(a_ptr + pair.to(tl.int64) * stride_am + k0 + ks, mask=k_ok, other=0.0).to(tl.float32)
                w = tl.load(b_ptr + expert * stride_be + cols[:, None].to(tl.int64) * stride_bn + k0 + ks[None, :],
                            mask=col_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
                if FP8:
                    w = w * tl.load(b_scale_ptr + expert * stride_se + cols, mask=col_ok, other=0.0)[:, None]
                acc += w * (x * coef)[None, :]
            result = tl.sum(acc, axis=1)
        tl.store(out_ptr + row.to(tl.int64) * stride_om + cols, result.to(out_ptr.dtype.element_ty), mask=col_ok)

    def run(a: torch.Tensor, a_scale: Optional[torch.Tensor], b: torch.Tensor, b_scale: Optional[torch.Tensor],
            out: torch.Tensor, ids: torch.Tensor, weights: Optional[torch.Tensor], gate_up: bool, block_n: int,
            block_k: int) -> None:
        """gate_up: out [T*k, I] = silu(gate) * up of x = a [T, H] through w13 = b [E, 2I, H] for each pair.
        Otherwise: out [T, H] = sum over k of weights[p] * (a [T*k, I] row p through w2 = b [E, H, I]).
        ids int32 [T, k] contiguous; weights float32 [T*k]; a_scale float32 (per row of a) and b_scale float32
        [E, N] for FP8 operands; a and out with unit column stride."""
        top_k = ids.shape[1]
        n, k = out.shape[1], a.shape[1]
        if a.stride(1) != 1 or out.stride(1) != 1 or b.shape[1] != (2 * n if gate_up else n) or b.shape[2] != k:
            raise ValueError(f"expert GEMV operands: a {tuple(a.shape)}, b {tuple(b.shape)}, out {tuple(out.shape)}")
        fp8 = b_scale is not None
        if fp8:
            b_scale = b_scale.reshape(b.shape[0], -1).contiguous()
        grid = (out.shape[0], triton.cdiv(n, block_n))
        kernel[grid](a, a_scale if fp8 else a, b, b_scale if fp8 else a, out, ids, weights if weights is not None
                     else a, n, k, a.stride(0), b.stride(0), b.stride(1), b_scale.stride(0) if fp8 else 0,
                     out.stride(0), TOP_K=top_k, GATE_UP=gate_up, FP8=fp8, BLOCK_N=block_n, BLOCK_K=block_k,
                     num_warps=4)

    return run
