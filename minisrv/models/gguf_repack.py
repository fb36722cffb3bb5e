"""GGUF tensors with 5-bit values or 256-weight super-blocks (Q5_0, Q5_1, Q4_K, Q5_K, Q6_K: the k-quant files'
mix) rewritten as the CPU kernels' records (kernels/cpu_blocks.c), exactly, vectorised in torch.

Every one of them is w = d * q + m per 32 weights with q a byte, or (Q6_K) w = d * (q - 32) per 16, once its
scales are unpacked (ggml's layouts, as ggml-quants.c reads them):
  Q5_0  22 bytes: f16 d, uint32 qh (bit j: weight j's fifth bit), 16 bytes of nibbles; w = d (q - 16)
  Q5_1  24 bytes: f16 d, f16 m, qh, nibbles; w = d q + m
  Q4_K  144 bytes a 256-weight super-block: f16 d, f16 dmin, 12 bytes of 6-bit scales and mins for its 8
        sub-blocks of 32, then 128 bytes: byte l of the j-th 32 holds sub-block 2j's weight l (low nibble) and
        2j+1's (high); w = (d sc) q - (dmin mn)
  Q5_K  176 bytes: as Q4_K with 32 bytes qh between scales and nibbles (bit s of qh[l]: sub-block s's fifth bit)
  Q6_K  210 bytes: 128 bytes ql, 64 qh, 16 int8 scales (one per 16 weights), f16 d; within each half of 128:
        weight 32 t + l is ql[l + 32 (t % 2)]'s low (t < 2) or high nibble, with qh[l]'s bits 2t..2t+1 on top;
        w = (d sc) (q - 32)
d sc and dmin mn are products of an f16 and an integer below 2^7: exact in float32, and so is d sc times a
q below 2^6; the single rounding of d' q + m' is then the one gguf's float32 dequantiser makes (tests check both
against a float64 reading of the format and against gguf).
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Tuple

import numpy as np
import torch
from gguf.constants import GGMLQuantizationType as Q

ROW_CHUNK = 256  # rows repacked at a time (bounds the temporaries)
Scales = Tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]  # (d, m or the second d, q, layout)


def f16(b: torch.Tensor, at: int) -> torch.Tensor:
    """The float16 at byte `at` of each block, as float32 [..., 1]."""
    return b[..., at:at + 2].contiguous().view(torch.float16).float()


def nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., 16] bytes -> [..., 32]: the low nibbles first, then the high ones."""
    return torch.cat([qs & 15, qs >> 4], dim=-1)


def _bits(b: torch.Tensor, width: int, step: int, mask: int) -> torch.Tensor:
    """[..., n] bytes -> [..., width / step ... ]: each byte's fields of `mask` at shifts 0, step, .. < width, the
    shift the second to last axis."""
    shifts = torch.arange(0, width, step, dtype=torch.uint8).reshape(-1, 1)
    return (b.unsqueeze(-2) >> shifts) & mask


def q5_values(b: torch.Tensor, at: int) -> torch.Tensor:
    """Q5_0/Q5_1's 32 5-bit values from the uint32 qh at byte `at` and the 16 bytes of nibbles after it."""
    high = _bits(b[..., at:at + 4], 8, 1, 1).transpose(-1, -2).flatten(-2)  # bit 8 i + j: weight 8 i + j
    return nibbles(b[..., at + 4:at + 20]) | (high << 4)


def scale_min_k4(s: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """12 bytes -> the 8 sub-blocks' 6-bit scales and mins (ggml's get_scale_min_k4)."""
    lo, mid, hi = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = torch.cat([lo & 63, (hi & 15) | ((lo >> 2) & 48)], dim=-1)
    mn = torch.cat([mid & 63, (hi >> 4) | ((mid >> 2) & 48)], dim=-1)
    return sc, mn


def _k_scales(b: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    sc, mn = scale_min_k4(b[..., 4:16])
    return f16(b, 0) * sc.float(), -(f16(b, 2) * mn.float())


def k_low(qs: torch.Tensor) -> torch.Tensor:
    """Q4_K/Q5_K's 128 bytes of nibbles -> the 8 sub-blocks' low 4 bits, [..., 8, 32]."""
    qs = qs.unflatten(-1, (4, 1, 32))
    return torch.cat([qs & 15, qs >> 4], dim=-2).flatten(-3, -2)


def q5_k_values(b: torch.Tensor) -> torch.Tensor:
    """Q5_K's 8 sub-blocks' 5-bit values, [..., 8, 32]."""
    return k_low(b[..., 48:176]) | (_bits(b[..., 16:48], 8, 1, 1) << 4)


def q6_k_values(b: torch.Tensor) -> torch.Tensor:
    """Q6_K's 256 6-bit values as [..., 8, 32]."""
    ql = b[..., :128].unflatten(-1, (2, 1, 64))
    low = torch.cat([ql & 15, ql >> 4], dim=-2).flatten(-2)  # [.., 2 halves, 128]
    high = _bits(b[..., 128:192].unflatten(-1, (2, 32)), 8, 2, 3).flatten(-2)  # [.., 2, 128]
    return (low | (high << 4)).flatten(-2).unflatten(-1, (8, 32))


def _q6_k(b: torch.Tensor) -> Scales:
    d = (f16(b, 208) * b[..., 192:208].contiguous().view(torch.int8).float()).unflatten(-1, (8, 2))
    return d[..., 0], d[..., 1], q6_k_values(b), 1


REPACKERS: Dict[int, Tuple[int, int, Callable[[torch.Tensor], Scales]]] = {
    # ggml type: (weights a block, bytes a block, its reading)
    Q.Q5_0: (32, 22, lambda b: (f16(b, 0)[..., 0], f16(b, 0)[..., 0] * -16.0, q5_values(b, 2), 0)),
    Q.Q5_1: (32, 24, lambda b: (f16(b, 0)[..., 0], f16(b, 2)[..., 0], q5_values(b, 4), 0)),
    Q.Q4_K: (256, 144, lambda b: (*_k_scales(b), k_low(b[..., 16:144]), 0)),
    Q.Q5_K: (256, 176, lambda b: (*_k_scales(b), q5_k_values(b), 0)),
    Q.Q6_K: (256, 210, _q6_k),
}


def records(d: torch.Tensor, m: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """[rows, cols / 32] scales and [rows, cols] q -> records [rows / 4, cols / 32, 160] (cpu_blocks.c's layout)."""
    rows, nb = d.shape
    g = rows // 4

    def by_group(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(g, 4, nb, -1).transpose(1, 2).reshape(g, nb, -1)
    scales = torch.cat([by_group(d.unsqueeze(-1)), by_group(m.unsqueeze(-1))], dim=-1).contiguous()
    return torch.cat([scales.view(torch.uint8), by_group(q.reshape(rows, nb, 32))], dim=-1)


def repack(data: Any, kind: int, src_rows: Optional[torch.Tensor], out: torch.Tensor, layouts: torch.Tensor) -> None:
    """Writes out (records [n / 4, k / 32, 160] uint8) and layouts ([n / 4] uint8) from a GGUF tensor's bytes
    (`data`, a [rows, k] matrix of type `kind`), row r of W being the file's row src_rows[r] (None: row r)."""
    per, size, read = REPACKERS[int(kind)]
    n, k = out.shape[0] * 4, out.shape[1] * 32
    raw = np.asarray(data, dtype=np.uint8).reshape(-1, k // per * size)
    for r0 in range(0, n, ROW_CHUNK):
        rows = np.arange(r0, min(n, r0 + ROW_CHUNK)) if src_rows is None else src_rows[r0:r0 + ROW_CHUNK].numpy()
        b = torch.from_numpy(raw[rows]).unflatten(-1, (k // per, size))
        d, m, q, layout = read(b)
        out[r0 // 4:(r0 + len(rows)) // 4] = records(d.reshape(len(rows), -1), m.reshape(len(rows), -1), q)
        layouts[r0 // 4:(r0 + len(rows)) // 4] = layout
