"""A mixture of experts' 4-bit weights with 16-bit activations, in the two layouts kernels/moe_gemm.py's grouped GEMM
reads: integers with a scale and zero per group (PackedExperts: AWQ, GPTQ, compressed-tensors) and MXFP4
(Mxfp4Experts: gpt-oss).

PackedExperts: the experts' [K, N] matrices in kernels/w4a16_gemm.py's layout, stacked, as the grouped GEMM (INT4)
and the dense kernel's decode pairs read them:

- qweight int32 [E, K/8, N]: row k of expert e's W [K, N] is nibble k % 8 of word [e, k // 8, n];
- scales [E, K/G, N] (float16 or bfloat16) and zeros uint8 [E, K/G, N]: W[k, n] = (q - zero) * scale of k's group;
- perm int64 [E, K] or None: activation order (GPTQ desc_act), the input column each row of K reads, per expert.

Gate/up's N is 2I (the gate's columns, then the up's), K the hidden size; down's N is the hidden size, K is I.
Off CUDA (and as the tests' reference) `PackedExperts.product` dequantises one expert and multiplies in torch.

Mxfp4Experts: the OCP microscaling format as the hub ships gpt-oss, rows of the [N, K] weights (N outputs, gate rows
then up rows for gate/up): blocks uint8 [E, N, K/2], two e2m1 values a byte (the even k in the low nibble: sign,
two exponent bits, one mantissa bit: 0, 0.5, 1, 1.5, 2, 3, 4, 6), and scales uint8 [E, N, K/32], an e8m0 exponent
for each 32 values of a row: W[n, k] = e2m1(k) * 2^(scale - 127).
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from minisrv.kernels.w4a16_gemm import dequantized_matmul


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
        return dequantized_matmul(a, self.qweight[expert], self.scales[expert], self.zeros[expert])


E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def mxfp4_dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[..., N, K/2] bytes and [..., N, K/32] exponents -> W [..., N, K] in `dtype` (exact in float32 and bfloat16)."""
    lut = torch.tensor(E2M1, dtype=torch.float32, device=blocks.device)
    b = blocks.long()
    w = torch.stack([lut[b & 0xF], lut[b >> 4]], dim=-1).flatten(-2)  # [..., N, K]
    w = w.unflatten(-1, (scales.shape[-1], 32)) * torch.exp2(scales.float() - 127)[..., None]
    return w.flatten(-2).to(dtype)


class Mxfp4Experts(NamedTuple):
    """E experts' weights [N, K] in MXFP4 (the module docstring's layout)."""

    blocks: torch.Tensor
    scales: torch.Tensor

    @property
    def num_experts(self) -> int:
        return self.blocks.shape[0]

    @property
    def k(self) -> int:
        return self.blocks.shape[2] * 2

    @property
    def n(self) -> int:
        return self.blocks.shape[1]

    def check(self, k: int, n: int, what: str) -> None:
        """Raises ValueError unless these are E experts' [n, k] MXFP4 weights."""
        e = self.num_experts
        if (self.k != k or self.n != n or k % 32 or tuple(self.scales.shape) != (e, n, k // 32)
                or self.blocks.dtype != torch.uint8 or self.scales.dtype != torch.uint8):
            raise ValueError(f"MXFP4 experts' {what}: blocks {tuple(self.blocks.shape)} {self.blocks.dtype}, scales "
                             f"{tuple(self.scales.shape)} {self.scales.dtype}; expected [E, {n}, {k}/2] and "
                             f"[E, {n}, {k}/32] uint8")

    def product(self, a: torch.Tensor, expert: int) -> torch.Tensor:
        """a [rows, K] @ expert's W^T, in a's dtype (W exact in a's dtype, as the kernel's tile)."""
        return a @ mxfp4_dequantize(self.blocks[expert], self.scales[expert], a.dtype).t()
