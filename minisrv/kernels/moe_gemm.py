"""The experts' grouped GEMM: for pairs aligned by expert (kernels/moe_align.py), each program multiplies BLOCK_M
rows of one expert's pairs by a BLOCK_N-column tile of that expert's weight. The two products of the experts' MLP
are two launches of it:
- gate/up: A = the tokens' rows of x (pair // top_k), B = w13[e] [2I, H]; each program accumulates a gate tile and
  the matching up tile (columns n and I + n) and writes silu(gate) * up, so [T*k, 2I] never goes to memory;
- down: A = those rows [T*k, I], B = w2[e] [H, I]; the output row of pair p is scaled by its routing weight and
  written to row p of [T*k, H] (summed over k by the caller).
FP8 (W8A8): A and B in float8_e4m3fn, the dot accumulating in float32, the tile scaled by a_scale[row] *
b_scale[e, col] (a scale per token and per output row of the weight, as Fp8Linear's), before SiLU and the routing
weight. 4-bit (W4A16, kernels/moe_w4a16.py's PackedExperts): each program dequantises a [BLOCK_K, BLOCK_N] tile of
its expert in registers from a [BLOCK_K / 8, BLOCK_N] block of words (BLOCK_K, halved until it divides the group,
reads one row of scales and zeros a step) and feeds it to tl.dot: no weight wider than 4 bits goes to memory; with an
activation order, A's columns are gathered through the expert's perm. MXFP4 (kernels/moe_w4a16.py's Mxfp4Experts):
the tile from [BLOCK_K / 2, BLOCK_N] bytes of the rows of W, each e2m1 nibble times its 32 values' e8m0 exponent
(2^(s - 127)) made by integer arithmetic: for bf16 activations the bf16 bits directly (the exponent added to the
exponent field), else a float32 scaled in float32; exact either way.
gpt-oss's experts: biases added to each product before the activation and the routing weight (BIAS), and the
clamped SwiGLU (CLAMP, ClampedSwiGLU) in place of SiLU-and-mul.

Programs whose block lies past the padded total (the grid is sized for the most blocks T, k and E can take) exit
after one load, so the grid is fixed by the shapes and the launch is captured in CUDA graphs.
"""
from __future__ import annotations

from types import ModuleType
from typing import Callable, NamedTuple, Optional, Union

import torch

from minisrv.kernels.moe_align import Aligned
from minisrv.kernels.moe_w4a16 import Mxfp4Experts, PackedExperts
from minisrv.kernels.triton_launcher import triton_launcher


class ClampedSwiGLU(NamedTuple):
    """gpt-oss's activation of its experts' gate/up product: min(gate, limit) * sigmoid(alpha * min(gate, limit)) *
    (clamp(up, -limit, limit) + 1)."""

    alpha: float
    limit: float

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
        return gate * torch.sigmoid(gate * self.alpha) * (up + 1)


class MoeConfig(NamedTuple):
    """Launch parameters of both products."""

    block_m: int  # rows (pairs of one expert) a program owns; the alignment pads groups to it
    block_n: int  # output columns a program owns (gate/up: this many gate and as many up columns)
    block_k: int  # the reduction's step
    num_warps: int
    num_stages: int


def config_for(n_pairs: int, num_experts: int, fp8: bool, mxfp4: bool = False) -> MoeConfig:
    """Launch parameters for n_pairs = T * top_k pairs over num_experts experts, by the pairs per expert hit
    (T * k / min(E, T * k)). From H100 sweeps of Qwen3-30B-A3B's layer (scripts/bench_fused_moe.py: H 2048, I 768,
    top-8 of 128 experts, T = 1 to 8192).

    Up to 16 a expert (decode, up to 256 tokens of top-8 over 128 experts) each product is a weight read: 16-row
    blocks (the tensor-core minimum, little padding) and 64-column tiles with K steps of 256 bytes, so the programs
    of the few experts hit spread over the SMs with bytes in flight. More pairs make it a matrix product: 64-row
    blocks and 128-column tiles read each weight tile once for 64 rows; from 128 a expert (2,048 tokens) 128-row
    blocks with 8 warps (docs/kernels.md has the measurements behind each choice).
    K steps are counted in bytes: FP8 takes twice the elements of bf16 a step.
    MXFP4 decodes its tiles in registers with integer arithmetic that holds many of them: K steps of 64 and
    64-column tiles with 4 warps (H100 sweeps of gpt-oss-20b's experts: longer steps and wider tiles ran slower).
    """
    per_expert = n_pairs / max(1, min(num_experts, n_pairs))
    if mxfp4:
        return MoeConfig(16 if per_expert <= 16 else 64, 64, 64, 4, 4)
    if per_expert <= 16:
        return MoeConfig(16, 64, 256 if fp8 else 128, 4, 4)
    if per_expert < 128:
        return MoeConfig(64, 128, 128 if fp8 else 64, 4 if fp8 else 8, 4)
    return MoeConfig(128, 128, 128 if fp8 else 64, 8, 4)


@triton_launcher
def moe_gemm(triton: ModuleType, tl: ModuleType) -> Callable[..., None]:
    """The launcher `run(a, a_scale, b, b_scale, out, weights, aligned, top_k, silu, config)` (see `run`), or None
    where Triton is missing."""

    @triton.jit
    def moe_grouped_gemm(a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, zeros_ptr, perm_ptr, c_ptr, weights_ptr, bias_ptr,
                         sorted_ptr, expert_ids_ptr, num_padded_ptr, n_pairs, n, k, group, stride_am, stride_be,
                         stride_bn, stride_bk, stride_se, stride_cm, stride_bias, alpha, limit, TOP_K: tl.constexpr,
                         SILU: tl.constexpr, FP8: tl.constexpr, INT4: tl.constexpr, MXFP4: tl.constexpr,
                         BF16_BITS: tl.constexpr,
                         PERM: tl.constexpr, WEIGHTED: tl.constexpr, BIAS: tl.constexpr, CLAMP: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """Program pid: block pid // tiles of the aligned pairs, output columns (pid % tiles) * BLOCK_N onwards.
        A's row of pair p is p // TOP_K (gate/up: the token; down: TOP_K = 1, the pair's own row). SILU: columns
        [0, n) are gate, [n, 2n) up, and the output is n wide. INT4: B is kernels/moe_w4a16.py's 4-bit layout
        (b_ptr the words, b_scale_ptr the groups' scales, zeros_ptr their zeros; BLOCK_K divides the group), each
        [BLOCK_K, BLOCK_N] tile dequantised in registers before the dot; PERM: A's columns read through the
        expert's activation order. MXFP4: b_ptr the bytes [E, N, K/2] (rows stride_bn apart), b_scale_ptr the
        exponents [E, N, K/32]. BIAS: bias_ptr [E, N] (rows stride_bias apart) added to the product; CLAMP: the
        clamped SwiGLU with alpha and limit."""
        pid = tl.program_id(0)
        tiles = tl.cdiv(n, BLOCK_N)
        block = pid // tiles
        if block * BLOCK_M >= tl.load(num_padded_ptr):
            return
        expert = tl.load(expert_ids_ptr + block).to(tl.int64)
        pairs = tl.load(sorted_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
        row_ok = pairs < n_pairs
        a_rows = (pairs // TOP_K).to(tl.int64)
        cols = (pid % tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < n
        ks = tl.arange(0, BLOCK_K)
        shifts = (tl.arange(0, 8) * 4)[None, :, None]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, k, BLOCK_K):
            k_ok = ks < k - k0  # (INT4: K is whole groups of whole steps)
            a_ok = row_ok[:, None] if INT4 else row_ok[:, None] & k_ok[None, :]
            a_cols = tl.load(perm_ptr + expert * k + k0 + ks) if PERM else k0 + ks
            a = tl.load(a_ptr + a_rows[:, None] * stride_am + a_cols[None, :], mask=a_ok, other=0.0)
            for part in tl.static_range(1 + SILU):  # the gate's columns, then (SILU) the up's
                c = cols + part * n
                if INT4:
                    words = tl.load(b_ptr + expert * stride_be + (k0 // 8 + tl.arange(0, BLOCK_K // 8))[:, None]
                                    * stride_bk + c[None, :], mask=col_ok[None, :], other=0)
                    g = expert * stride_se + (k0 // group) * stride_bk + c
                    scale = tl.load(b_scale_ptr + g, mask=col_ok, other=0.0).to(tl.float32)
                    zero_magic = tl.load(zeros_ptr + g, mask=col_ok, other=0).to(tl.float32) + 8388608.0
                    # a nibble under float32's exponent of 2^23 reads as 2^23 + q (kernels/w4a16_gemm.py)
                    bits = (((words[:, None, :] >> shifts) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True)
                    b = ((tl.reshape(bits, (BLOCK_K, BLOCK_N)) - zero_magic[None, :]) * scale[None, :]).to(a.dtype)
                elif MXFP4:  # (K is whole 32s: the last step's rows past K masked)
                    kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
                    pairs8 = tl.load(b_ptr + expert * stride_be + c[None, :] * stride_bn + kb[:, None],
                                     mask=col_ok[None, :] & (kb < k // 2)[:, None], other=0).to(tl.int32)
                    q = tl.reshape((pairs8[:, None, :] >> (tl.arange(0, 2) * 4)[None, :, None]) & 0xF,
                                   (BLOCK_K, BLOCK_N))  # row 2j + i: nibble i of byte j
                    kg = k0 // 32 + tl.arange(0, BLOCK_K // 32)
                    s8 = tl.load(b_scale_ptr + expert * stride_se + c[None, :] * (k // 32) + kg[:, None],
                                 mask=col_ok[None, :] & (kg < k // 32)[:, None], other=0).to(tl.int32)
                    em = q & 7  # e2m1: 2^(e - 1) (1 + m / 2) for exponent e = em >> 1 > 0, else m / 2
                    sign = (q & 8).to(tl.uint32) << 12
                    if BF16_BITS:  # times 2^(s - 127) as bfloat16's bits: exponent field e + s - 1 over mantissa
                        # bit m, i.e. em << 6 added to (s - 1) << 7; em 1 (a half) is (s - 1) << 7, em 0 zero
                        # (a scale of 2^-127 reads as 2^-126)
                        mag = tl.reshape(tl.where(em > 1, em << 6, 0), (BLOCK_K // 32, 32, BLOCK_N)) \
                            + ((tl.maximum(s8, 1) - 1) << 7)[:, None, :]
                        mag = tl.where(tl.reshape(em, (BLOCK_K // 32, 32, BLOCK_N)) == 0, 0, mag)
                        b = (tl.reshape(mag, (BLOCK_K, BLOCK_N)).to(tl.uint32) | sign).to(tl.int16).to(
                            a.dtype, bitcast=True)
                    else:  # float32 bits (exponent e - 1, or m / 2), times 2^(s - 127), in a's dtype
                        e, m = em >> 1, em & 1
                        bits = tl.where(e > 0, ((e + 126) << 23) | (m << 22), m * (126 << 23)).to(tl.uint32) \
                            | (sign << 16)
                        scale = (s8.to(tl.uint32) << 23).to(tl.float32, bitcast=True)
                        b = tl.reshape(tl.reshape(bits.to(tl.float32, bitcast=True), (BLOCK_K // 32, 32, BLOCK_N))
                                       * scale[:, None, :], (BLOCK_K, BLOCK_N)).to(a.dtype)
                else:
                    b = tl.load(b_ptr + expert * stride_be + (k0 + ks)[:, None] * stride_bk + c[None, :] * stride_bn,
                                mask=k_ok[:, None] & col_ok[None, :], other=0.0)
                if part == 0:
                    acc = tl.dot(a, b, acc)
                else:
                    up = tl.dot(a, b, up)
        if FP8:
            a_scale = tl.load(a_scale_ptr + a_rows, mask=row_ok, other=0.0)[:, None]
            scale_ptrs = b_scale_ptr + expert * stride_se + cols
            acc = acc * a_scale * tl.load(scale_ptrs, mask=col_ok, other=0.0)[None, :]
            if SILU:
                up = up * a_scale * tl.load(scale_ptrs + n, mask=col_ok, other=0.0)[None, :]
        if BIAS:
            bias_ptrs = bias_ptr + expert * stride_bias + cols
            acc += tl.load(bias_ptrs, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            if SILU:
                up += tl.load(bias_ptrs + n, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        if CLAMP:
            acc = tl.minimum(acc, limit)
            acc = acc / (1.0 + tl.exp(-alpha * acc)) * (tl.minimum(tl.maximum(up, -limit), limit) + 1.0)
        elif SILU:
            acc = acc / (1.0 + tl.exp(-acc)) * up
        if WEIGHTED:
            acc = acc * tl.load(weights_ptr + pairs, mask=row_ok, other=0.0)[:, None]
        out_ptrs = c_ptr + pairs.to(tl.int64)[:, None] * stride_cm + cols[None, :]
        tl.store(out_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])

    def run(a: torch.Tensor, a_scale: Optional[torch.Tensor], b: Union[torch.Tensor, PackedExperts, Mxfp4Experts],
            b_scale: Optional[torch.Tensor], out: torch.Tensor, weights: Optional[torch.Tensor], aligned: Aligned,
            top_k: int, silu: bool, config: MoeConfig, bias: Optional[torch.Tensor] = None,
            swiglu: Optional[ClampedSwiGLU] = None) -> None:
        """out[p] = (silu(gate) * up if silu else the product) of A's row p // top_k and expert e(p)'s B, times
        weights[p] if weights is given, for every aligned pair p. a [rows, K] with unit column stride; b [E, N, K]
        (N = 2 * out's width if silu), 4-bit PackedExperts of [K, N] matrices or Mxfp4Experts of [N, K] ones
        (contiguous, no b_scale); a_scale float32 [rows] or [rows, 1] and b_scale float32 [E, N] for FP8 operands;
        out [T*k, n] with unit column stride; weights float32, contiguous [T*k]; bias [E, N] with unit column
        stride, added to the product; swiglu: the clamped SwiGLU in place of SiLU-and-mul (with silu)."""
        n = out.shape[1]
        k = a.shape[1]
        width = 2 * n if silu else n
        int4, mxfp4 = isinstance(b, PackedExperts), isinstance(b, Mxfp4Experts)
        if a.stride(1) != 1 or out.stride(1) != 1 or (bias is not None and (bias.stride(1) != 1
                                                                              or bias.shape[1] != width)) \
                or (not int4 and not mxfp4 and (b.shape[1] != width or b.shape[2] != k)):
            raise ValueError(f"grouped GEMM operands: a {tuple(a.shape)} (column stride {a.stride(1)}), b "
                             f"{tuple(b.shape)}, out {tuple(out.shape)} (column stride {out.stride(1)}), silu {silu}")
        block_k = config.block_k
        if int4 or mxfp4:
            if a_scale is not None or b_scale is not None:
                raise ValueError("4-bit experts take 16-bit activations and no separate weight scales")
            b.check(k, width, "grouped GEMM operand")
            if not all(t.is_contiguous() for t in b if t is not None):
                raise ValueError("4-bit grouped GEMM operands: the experts' tensors must be contiguous")
        if mxfp4:  # bytes [E, N, K/2], exponents [E, N, K/32]: a row of W is K/2 bytes
            tensors, group, strides = (b.blocks, b.scales, a, None), 32, (b.blocks.stride(0), k // 2, 1,
                                                                          b.scales.stride(0))
        elif int4:
            while b.group % block_k:  # (groups are multiples of 16: b.check)
                block_k //= 2
            # words [E, K/8, W]; scales and zeros [E, K/G, W]: a row of either is W apart
            tensors, group, strides = b, b.group, (b.qweight.stride(0), 1, width, b.scales.stride(0))
        else:
            if b_scale is not None:
                b_scale = b_scale.reshape(b.shape[0], -1)
                if b_scale.stride(1) != 1:
                    b_scale = b_scale.contiguous()
            tensors, group = (b, b_scale if b_scale is not None else a, a, None), 1
            strides = (b.stride(0), b.stride(1), b.stride(2), b_scale.stride(0) if b_scale is not None else 0)
        words, scales, zeros, perm = tensors
        grid = (aligned.expert_ids.numel() * triton.cdiv(n, config.block_n),)
        moe_grouped_gemm[grid](a, a_scale if a_scale is not None else a, words, scales, zeros,
                               perm if perm is not None else a, out, weights if weights is not None else a,
                               bias if bias is not None else a, aligned.sorted_pairs, aligned.expert_ids,
                               aligned.num_padded, out.shape[0], n, k, group, a.stride(0), *strides, out.stride(0),
                               bias.stride(0) if bias is not None else 0, *(swiglu or (1.0, 0.0)), TOP_K=top_k,
                               SILU=silu, FP8=b_scale is not None and not int4 and not mxfp4, INT4=int4,
                               MXFP4=mxfp4, BF16_BITS=a.dtype == torch.bfloat16,
                               PERM=perm is not None, WEIGHTED=weights is not None, BIAS=bias is not None,
                               CLAMP=swiglu is not None and silu, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
                               BLOCK_K=block_k, num_warps=config.num_warps, num_stages=config.num_stages)

    return run
