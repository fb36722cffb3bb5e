"""Projections of a few rows on the CPU (cpu_gemv.c): what a decode step's linear layers and LM head compute, where
torch's matmul leaves most of the memory bandwidth unused (see the C file). Larger row counts (prompts) stay with
torch's matmul, which is faster there.
"""
from __future__ import annotations

import ctypes
from typing import Optional

import torch

from .cpu_build import I64, INT, PTR, CompiledKernels, c_function

# up to this many rows the kernel is used: measured against torch's matmul on the default model's projections
# (scripts/bench_cpu_gemv.py, docs/benchmarks.md)
MAX_ROWS = 32


class SmallBatchLinear(CompiledKernels):
    """The compiled kernel (`SmallBatchLinear.load()`; None where it cannot be built)."""

    SOURCE = "cpu_gemv"

    def __init__(self, lib: ctypes.CDLL, how: str, max_rows: int = MAX_ROWS) -> None:
        self.fn = c_function(lib, "gemv_f32", None, PTR, I64, PTR, PTR, I64, INT, I64, I64)
        self.how = how
        self.max_rows = max_rows

    def takes(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether the kernel computes x @ weight.T: 2-D float32 x of at most max_rows rows with unit column
        stride, a contiguous float32 weight, no gradient wanted (the kernel has no backward)."""
        return (x.dim() == 2 and 0 < x.shape[0] <= self.max_rows and x.dtype == weight.dtype == torch.float32
                and x.stride(1) == 1 and weight.is_contiguous() and x.shape[1] == weight.shape[1]
                and x.device.type == "cpu"
                and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)))

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x @ weight.T (+ bias): x [m, k] float32 with unit column stride, weight [n, k] contiguous; see takes()."""
        m, k = x.shape
        n = weight.shape[0]
        y = torch.empty((m, n), dtype=torch.float32)
        self.fn(x.data_ptr(), x.stride(0), weight.data_ptr(), y.data_ptr(), y.stride(0), m, n, k)
        if bias is not None:
            y += bias
        return y


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
           small: Optional[SmallBatchLinear]) -> torch.Tensor:
    """F.linear(x, weight, bias), through `small` where it takes these operands (2-D x of at most max_rows rows)."""
    if small is not None and small.takes(x, weight):
        return small(x, weight, bias)
    return torch.nn.functional.linear(x, weight, bias)
