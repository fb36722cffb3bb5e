"""A GGUF model's matrices kept in their blocks on the GPU: each tensor's bytes rewritten, a chunk of rows at a time,
as the planes of kernels/w4a16_gemm.BlockPlanes, which the W4A16 GEMM reads with its weight type a compile-time
constant. Every field of a block keeps its width (the low nibbles in the 4-bit layout, the bits above them in a plane
of their own, the float16 d and dmin, the 6- or 8-bit sub-block scales and mins a byte each), so a matrix takes its
file's bytes (Q4_K and Q5_K: 148 and 180 of 144 and 176 bytes a block, the sub-block fields' padding; the others
exactly), and no wider copy of it exists on the host or the device at any time.

The GPU's types (`PLANE_FORMATS`) are Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and the k-quants Q4_K, Q5_K and Q6_K of a Q4_K_M
file's mix; a block's fields are read as gguf_repack.py reads them for the CPU's records.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Tuple

import numpy as np
import torch
from gguf.constants import GGML_QUANT_SIZES
from gguf.constants import GGMLQuantizationType as Q

from minisrv.kernels.w4a16_gemm import BlockFormat, BlockPlanes, pack_rows

from .gguf_repack import k_low, nibbles, q5_k_values, q5_values, q6_k_values, scale_min_k4

ROW_CHUNK = 1024  # output rows converted at a time (bounds the host's temporaries)

PLANE_FORMATS: Dict[int, BlockFormat] = {  # (high_bits, sub, block, zero, scaled, mins)
    Q.Q4_0: BlockFormat(0, 32, 32, 8, False, 0), Q.Q4_1: BlockFormat(0, 32, 32, 0, False, 1),
    Q.Q5_0: BlockFormat(1, 32, 32, 16, False, 0), Q.Q5_1: BlockFormat(1, 32, 32, 0, False, 1),
    Q.Q8_0: BlockFormat(4, 32, 32, 128, False, 0),
    Q.Q4_K: BlockFormat(0, 32, 256, 0, True, 2), Q.Q5_K: BlockFormat(1, 32, 256, 0, True, 2),
    Q.Q6_K: BlockFormat(2, 16, 256, 32, True, 0),
}

# a block's fields: q uint8 [..., weights], d float16 [...], sub-block scales [..., subs] (uint8; Q6_K int8),
# dmin float16 [...] (Q4_1, Q5_1: the block's m negated, w = d q - dmin), mins uint8 [..., 8]; None where absent
Fields = Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor], Optional[torch.Tensor]]


def _half(b: torch.Tensor, at: int) -> torch.Tensor:
    return b[..., at:at + 2].contiguous().view(torch.float16)[..., 0]


def _k_quant(values: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], Fields]:
    def read(b: torch.Tensor) -> Fields:
        sc, mn = scale_min_k4(b[..., 4:16])
        return values(b).flatten(-2), _half(b, 0), sc, _half(b, 2), mn
    return read


READERS: Dict[int, Callable[[torch.Tensor], Fields]] = {
    Q.Q4_0: lambda b: (nibbles(b[..., 2:18]), _half(b, 0), None, None, None),
    Q.Q4_1: lambda b: (nibbles(b[..., 4:20]), _half(b, 0), None, -_half(b, 2), None),
    Q.Q5_0: lambda b: (q5_values(b, 2), _half(b, 0), None, None, None),
    Q.Q5_1: lambda b: (q5_values(b, 4), _half(b, 0), None, -_half(b, 2), None),
    Q.Q8_0: lambda b: (b[..., 2:34] ^ 0x80, _half(b, 0), None, None, None),  # int8 v as the byte v + 128
    Q.Q4_K: _k_quant(lambda b: k_low(b[..., 16:144])),
    Q.Q5_K: _k_quant(q5_k_values),
    Q.Q6_K: lambda b: (q6_k_values(b).flatten(-2), _half(b, 208), b[..., 192:208].contiguous().view(torch.int8),
                       None, None),
}


def empty_planes(kind: int, k: int, n: int, device: torch.device) -> BlockPlanes:
    """Uninitialised planes of a [k, n] matrix (n output rows of W^T) of GGUF type `kind`."""
    f = PLANE_FORMATS[int(kind)]

    def plane(rows: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(rows, n, dtype=dtype, device=device)
    return BlockPlanes(f, plane(k // 8, torch.int32), plane(k // f.block, torch.float16),
                       plane(k * f.high_bits // 32, torch.int32) if f.high_bits else None,
                       plane(k // f.sub, torch.int8 if kind == Q.Q6_K else torch.uint8) if f.scaled else None,
                       plane(k // f.block, torch.float16) if f.mins else None,
                       plane(k // 32, torch.uint8) if f.mins == 2 else None)


def planes_of_fields(fmt: BlockFormat, fields: Fields) -> BlockPlanes:
    """The planes [*, r] of r rows' block fields ([r, blocks, ...])."""
    q, d, scales, dmin, mins = fields
    r = q.shape[0]
    q = q.reshape(r, -1).t()

    def column(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        return t.reshape(r, -1).t().contiguous() if t is not None else None
    return BlockPlanes(fmt, pack_rows(q & 15), column(d),
                       pack_rows(q >> 4, fmt.high_bits) if fmt.high_bits else None,
                       column(scales), column(dmin), column(mins))


@torch.no_grad()
def to_planes(data: Any, kind: int, rows: int, cols: int, src_rows: Optional[torch.Tensor],
              device: torch.device) -> BlockPlanes:
    """The planes, on `device`, of a GGUF tensor's [rows, cols] matrix (gguf's view of its bytes, a row a line),
    row r being the file's row src_rows[r] (None: row r): converted on the host ROW_CHUNK rows at a time."""
    per, size = GGML_QUANT_SIZES[Q(int(kind))]
    raw = np.asarray(data, dtype=np.uint8).reshape(-1, cols // per * size)
    out = empty_planes(kind, cols, rows, device)
    for r0 in range(0, rows, ROW_CHUNK):
        r1 = min(rows, r0 + ROW_CHUNK)
        pick = slice(r0, r1) if src_rows is None else src_rows[r0:r1].numpy()
        b = torch.from_numpy(np.array(raw[pick])).unflatten(-1, (cols // per, size))
        chunk = planes_of_fields(out.fmt, READERS[int(kind)](b))
        for dst, src in zip(out[1:], chunk[1:]):
            if dst is not None:
                dst[:, r0:r1].copy_(src, non_blocking=False)
    return out
