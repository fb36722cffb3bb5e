"""A mixture of experts' 4-bit weights (W4A16): the experts' [K, N] matrices in kernels/w4a16_gemm.py's layout,
stacked, as kernels/moe_gemm.py's grouped GEMM (INT4) and the dense kernel's decode pairs read them:

- qweight int32 [E, K/8, N]: row k of expert e's W [K, N] is nibble k % 8 of word [e, k // 8, n];
- scales [E, K/G, N] (float16 or bfloat16) and zeros uint8 [E, K/G, N]: W[k, n] = (q - zero) * scale of k's group;
- perm int64 [E, K] or None: activation order (GPTQ desc_act), the input column each row of K reads, per expert.

Gate/up's N is 2I (the gate's columns, then the up's), K the hidden size; down's N is the hidden size, K is I.
Off CUDA (and as the tests' reference) `PackedExperts.product` dequantises one expert and multiplies in torch.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

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
