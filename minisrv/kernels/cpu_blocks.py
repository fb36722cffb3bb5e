"""Projections over weights kept in llama.cpp's 32-wide blocks on the CPU (cpu_blocks.c): a GGUF model's projections
and embedding in Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K or Q6_K stay at 1.25 bytes a weight (models/gguf_blocks.py
packs them) instead of 4 as float32, with the same weight values. A decode step reads every weight once, so it reads
a third of the bytes. A matrix comes as its records and one layout byte a group of 4 rows (0: d and m per 32
weights; 1: Q6_K's d per 16, m = -32 d).

Up to MAX_ROWS rows of x go through the kernel; more (a prompt) through torch's matmul over the dequantised
matrix, which is faster there (the dequantisation is a small part of a prompt's matmul).
"""
from __future__ import annotations

import ctypes
from typing import Optional

import numpy as np
import torch

from .cpu_build import I64, INT, PTR, CompiledKernels, c_function

MAX_ROWS = 32  # cpu_blocks.c's MAX_M
RECORD_BYTES = 160  # 4 rows x 32 columns: float32 d[4], m[4], then uint8 q[4][32]
BLOCK_BYTES = {2: 18, 3: 20, 8: 34}  # a GGUF block of 32 weights: Q4_0, Q4_1, Q8_0 (ggml's type ids)


class BlockKernels(CompiledKernels):
    """The compiled kernels (`BlockKernels.load()`; None where they cannot be built)."""

    SOURCE = "cpu_blocks"

    def __init__(self, lib: ctypes.CDLL, how: str) -> None:
        self.how = f"{how}; {c_function(lib, 'blocks_simd_path', ctypes.c_char_p)().decode()} path"
        self._matmul = c_function(lib, "blocks_matmul", None, PTR, I64, PTR, PTR, PTR, I64, INT, I64, I64)
        self._dequant = c_function(lib, "blocks_dequant", None, PTR, PTR, PTR, I64, I64)
        self._rows = c_function(lib, "blocks_rows", None, PTR, PTR, PTR, I64, PTR, I64)
        self._pack = c_function(lib, "blocks_pack", INT, PTR, INT, PTR, I64, I64, PTR)

    def pack(self, raw: np.ndarray, kind: int, src_rows: Optional[torch.Tensor], out: torch.Tensor) -> None:
        """Writes out (records [n / 4, k / 32, 160] uint8, contiguous) from a GGUF tensor's blocks: raw, the file's
        bytes of a [rows, k] matrix (ggml type `kind`: Q4_0, Q4_1 or Q8_0), row r of W being the file's row
        src_rows[r] (int64; None: row r; W may take some of the file's rows: a fused matrix's part)."""
        n, blocks = out.shape[0] * 4, out.shape[1]
        if not (out.is_contiguous() and out.dtype == torch.uint8 and raw.flags["C_CONTIGUOUS"]):
            raise ValueError("blocks_pack needs contiguous bytes in and out")
        row_bytes = blocks * BLOCK_BYTES.get(int(kind), -1)
        file_rows = raw.nbytes // row_bytes if row_bytes > 0 else -1
        if raw.nbytes != file_rows * row_bytes or (src_rows is None and file_rows != n):
            raise ValueError(f"{raw.nbytes} bytes of GGUF type {kind} for a [{n}, {blocks * 32}] matrix")
        if src_rows is not None:
            src_rows = src_rows.to(torch.int64).contiguous()
            if src_rows.numel() != n or n and not 0 <= int(src_rows.min()) <= int(src_rows.max()) < file_rows:
                raise ValueError(f"{src_rows.numel()} source rows for {n} rows of the file's {file_rows}")
        if self._pack(raw.ctypes.data, kind, src_rows.data_ptr() if src_rows is not None else None, n,
                      blocks * 32, out.data_ptr()):
            raise ValueError(f"no block form for GGUF type {kind}")

    def matmul(self, x: torch.Tensor, packed: torch.Tensor, layouts: Optional[torch.Tensor], n: int,
               k: int) -> torch.Tensor:
        """x @ W.T for x [m, k] float32, W [n, k] packed (records [n / 4, k / 32, 160] uint8; layouts [n / 4]
        uint8, None: all 0): float32 [m, n]."""
        x = x if x.stride(-1) == 1 else x.contiguous()
        m = x.shape[0]
        if m > MAX_ROWS:
            return torch.matmul(x, self.dequant(packed, layouts, n, k).t())
        y = torch.empty((m, n), dtype=torch.float32)
        if m:
            self._matmul(x.data_ptr(), x.stride(0), packed.data_ptr(), _ptr(layouts), y.data_ptr(), y.stride(0), m,
                         n, k)
        return y

    def dequant(self, packed: torch.Tensor, layouts: Optional[torch.Tensor], n: int, k: int) -> torch.Tensor:
        """W as float32 [n, k]."""
        out = torch.empty((n, k), dtype=torch.float32)
        self._dequant(packed.data_ptr(), _ptr(layouts), out.data_ptr(), n, k)
        return out

    def rows(self, packed: torch.Tensor, layouts: Optional[torch.Tensor], ids: torch.Tensor, k: int) -> torch.Tensor:
        """W[ids] as float32 [len(ids), k] (ids: int64, each in [0, n))."""
        ids = ids.reshape(-1).to(torch.int64).contiguous()
        out = torch.empty((ids.numel(), k), dtype=torch.float32)
        self._rows(packed.data_ptr(), _ptr(layouts), ids.data_ptr(), ids.numel(), out.data_ptr(), k)
        return out


def _ptr(layouts: Optional[torch.Tensor]) -> Optional[int]:
    if layouts is None:
        return None
    if layouts.dtype != torch.uint8 or not layouts.is_contiguous():
        raise ValueError("block layouts are one contiguous uint8 a group of 4 rows")
    return layouts.data_ptr()
