"""The experts' grouped GEMM with 4-bit weights (W4A16): kernels/moe_gemm.py's two launches (gate/up with SiLU-and-mul
in the epilogue, down scaled by the routing weights) for experts held in kernels/w4a16_gemm.py's layout, stacked:

- qweight int32 [E, K/8, N]: row k of expert e's W [K, N] is nibble k % 8 of word [e, k // 8, n];
- scales [E, K/G, N] (float16 or bfloat16) and zeros uint8 [E, K/G, N]: W[k, n] = (q - zero) * scale of k's group;
- perm int64 [E, K] or None: activation order (GPTQ desc_act), the input column each row of K reads, per expert.

Gate/up's N is 2I (the gate's columns, then the up's), K the hidden size; down's N is the hidden size, K is I.
Each program dequantises a [BLOCK_K, BLOCK_N] tile of its expert in registers from a [BLOCK_K / 8, BLOCK_N] block of
words (BLOCK_K divides the group, so a K step reads one row of scales and zeros) and feeds it to tl.dot: no weight
wider than 4 bits goes to memory. With an activation order, A's columns are gathered through the expert's perm.
Same launch rule (moe_gemm.config_for's for bf16 weights, its K step halved until it divides the group), alignment,
grid and early exit as moe_gemm.py, so the router's alignment serves these launches and they are captured in CUDA
graphs.
Off CUDA (and as the tests' reference) `PackedExperts.product` dequantises one expert and multiplies in torch.
"""
from __future__ import annotations

from types import ModuleType
from typing import Callable, NamedTuple, Optional

import torch

from minisrv.kernels.moe_align import Aligned
from minisrv.kernels.moe_gemm import MoeConfig
from minisrv.kernels.triton_launcher import triton_launcher
from minisrv.kernels.w4a16_gemm import dequantize


class PackedExperts(NamedTuple):
    """E experts' weights [K, N] in 4 bits (the module docstring's layout)."""

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    perm: Optional[torch.Tensor] = None

    @property
    def num_experts(self) -> int:
        return self.qweight.shape[0]

    @property
    def k(self) -> int:
        return self.qweight.shape[1] * 8

    @property
    def n(self) -> int:
        return self.qweight.shape[2]

    @property
    def group(self) -> int:
        return self.k // self.scales.shape[1]

    def check(self, k: int, n: int, what: str) -> None:
        """Raises ValueError unless these are E experts' [k, n] weights in whole groups of a multiple of 16 rows."""
        e = self.num_experts
        groups = self.scales.shape[1]
        if (self.k != k or self.n != n or groups == 0 or k % groups or self.group % 16
                or tuple(self.scales.shape) != (e, groups, n) or tuple(self.zeros.shape) != (e, groups, n)
                or self.qweight.dtype != torch.int32 or self.zeros.dtype != torch.uint8
                or (self.perm is not None and tuple(self.perm.shape) != (e, k))):
            raise ValueError(f"4-bit experts' {what}: qweight {tuple(self.qweight.shape)} {self.qweight.dtype}, "
                             f"scales {tuple(self.scales.shape)}, zeros {tuple(self.zeros.shape)} "
                             f"{self.zeros.dtype}, perm {None if self.perm is None else tuple(self.perm.shape)}; "
                             f"expected [E, {k}/8, {n}] in groups of a multiple of 16 rows")

    def product(self, a: torch.Tensor, expert: int) -> torch.Tensor:
        """a [rows, K] @ expert's W, in a's dtype: W dequantised in float32 and rounded to a's dtype, as the
        kernel's tile is (float64 a: exact, the dequantised values are float32 numbers)."""
        if self.perm is not None:
            a = a[:, self.perm[expert]]
        w = dequantize(self.qweight[expert], self.scales[expert], self.zeros[expert])
        return a @ w.to(a.dtype)


@triton_launcher
def moe_w4a16_gemm(triton: ModuleType, tl: ModuleType) -> Callable[..., None]:
    """The launcher `run(a, a_scale, b, b_scale, out, weights, aligned, top_k, silu, config)` (moe_gemm's, whose
    scales are FP8's: None here), or None where Triton is missing."""

    @triton.jit
    def moe_w4a16_grouped_gemm(a_ptr, qw_ptr, s_ptr, z_ptr, perm_ptr, c_ptr, weights_ptr, sorted_ptr,
                               expert_ids_ptr, num_padded_ptr, n_pairs, n, k, group, stride_am, stride_cm,
                               TOP_K: tl.constexpr, SILU: tl.constexpr, WEIGHTED: tl.constexpr, PERM: tl.constexpr,
                               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """Program pid: block pid // tiles of the aligned pairs, output columns (pid % tiles) * BLOCK_N onwards, as
        moe_gemm's. SILU: the weight's columns [0, n) are gate, [n, 2n) up, and the output is n wide."""
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
        kw = tl.arange(0, BLOCK_K // 8)
        shifts = (tl.arange(0, 8) * 4)[None, :, None]
        width = n * (1 + SILU)  # the weight's columns
        qw = qw_ptr + expert * (k // 8) * width
        sz = expert * (k // group) * width  # the expert's scales and zeros
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, k, BLOCK_K):
            if PERM:
                a_cols = tl.load(perm_ptr + expert * k + k0 + ks)
            else:
                a_cols = k0 + ks
            a = tl.load(a_ptr + a_rows[:, None] * stride_am + a_cols[None, :], mask=row_ok[:, None], other=0.0)
            words_at = qw + (k0 // 8 + kw).to(tl.int64)[:, None] * width
            g = sz + (k0 // group) * width
            for part in tl.static_range(1 + SILU):  # the gate's columns, then (SILU) the up's
                c = cols + part * n
                words = tl.load(words_at + c[None, :], mask=col_ok[None, :], other=0)
                # a nibble under float32's exponent of 2^23 reads as 2^23 + q (kernels/w4a16_gemm.py)
                bits = (((words[:, None, :] >> shifts) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True)
                scale = tl.load(s_ptr + g + c, mask=col_ok, other=0.0).to(tl.float32)
                zero_magic = tl.load(z_ptr + g + c, mask=col_ok, other=0).to(tl.float32) + 8388608.0
                w = ((tl.reshape(bits, (BLOCK_K, BLOCK_N)) - zero_magic[None, :]) * scale[None, :]).to(a.dtype)
                if part == 0:
                    acc = tl.dot(a, w, acc)
                else:
                    up = tl.dot(a, w, up)
        if SILU:
            acc = acc / (1.0 + tl.exp(-acc)) * up
        if WEIGHTED:
            acc = acc * tl.load(weights_ptr + pairs, mask=row_ok, other=0.0)[:, None]
        out_ptrs = c_ptr + pairs.to(tl.int64)[:, None] * stride_cm + cols[None, :]
        tl.store(out_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])

    def run(a: torch.Tensor, a_scale: None, b: PackedExperts, b_scale: None, out: torch.Tensor,
            weights: Optional[torch.Tensor], aligned: Aligned, top_k: int, silu: bool, config: MoeConfig) -> None:
        """out[p] = (silu(gate) * up if silu else the product) of A's row p // top_k and expert e(p)'s W, times
        weights[p] if weights is given, for every aligned pair p. a [rows, K] bf16/fp16 with unit column stride;
        b the experts' [K, N] weights (N = 2 * out's width if silu), contiguous; out [T*k, n] with unit column
        stride; weights float32, contiguous [T*k]."""
        n, k = out.shape[1], a.shape[1]
        if a_scale is not None or b_scale is not None:
            raise ValueError("4-bit experts take 16-bit activations and no separate weight scales")
        b.check(k, 2 * n if silu else n, "grouped GEMM operand")
        if a.stride(1) != 1 or out.stride(1) != 1 or not all(t.is_contiguous() for t in b if t is not None):
            raise ValueError(f"4-bit grouped GEMM operands: a {tuple(a.shape)} (column stride {a.stride(1)}), out "
                             f"{tuple(out.shape)} (column stride {out.stride(1)}), contiguous weights")
        block_k = config.block_k
        while b.group % block_k:  # (groups are multiples of 16: b.check)
            block_k //= 2
        grid = (aligned.expert_ids.numel() * triton.cdiv(n, config.block_n),)
        moe_w4a16_grouped_gemm[grid](a, b.qweight, b.scales, b.zeros, b.perm if b.perm is not None else a, out,
                                     weights if weights is not None else a, aligned.sorted_pairs, aligned.expert_ids,
                                     aligned.num_padded, out.shape[0], n, k, b.group, a.stride(0), out.stride(0),
                                     TOP_K=top_k, SILU=silu, WEIGHTED=weights is not None, PERM=b.perm is not None,
                                     BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=block_k,
                                     num_warps=config.num_warps, num_stages=config.num_stages)

    return run
