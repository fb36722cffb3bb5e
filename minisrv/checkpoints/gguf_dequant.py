"""GGUF tensors dequantised with vectorised torch for Q4_0, Q4_1, Q8_0 and the float types (gguf's numpy path takes
about three times the CPU time, on every start without a cached model); other types go to gguf's own. The arithmetic
is gguf's, operation for operation, so the values are the same to the bit (tests/test_startup.py checks them)."""
from __future__ import annotations

from typing import Any

import numpy as np
import torch
from gguf.constants import GGMLQuantizationType as Q

from minisrv.models.gguf_repack import f16, nibbles

BLOCKS = {  # GGML type -> (bytes a block, its blocks [n, bytes] uint8 -> values [n, 32] float32)
    Q.Q4_0: (18, lambda b: f16(b, 0) * (nibbles(b[:, 2:]).to(torch.int8) - 8).float()),
    Q.Q4_1: (20, lambda b: f16(b, 0) * nibbles(b[:, 4:]).float() + f16(b, 2)),
    Q.Q8_0: (34, lambda b: f16(b, 0) * b[:, 2:].contiguous().view(torch.int8).float()),
}
FLOATS = {Q.F32: torch.float32, Q.F16: torch.float16, Q.BF16: torch.bfloat16}


def dequantize(data: Any, kind: Q) -> torch.Tensor:
    """A tensor's data (gguf's reader gives a numpy view of its bytes) as float32, flat."""
    if kind in BLOCKS:
        size, values = BLOCKS[kind]  # (a copy of the bytes: the file's memory map is read-only)
        return values(torch.from_numpy(np.array(data, dtype=np.uint8, copy=True).reshape(-1, size))).reshape(-1)
    if kind in FLOATS:
        return torch.from_numpy(np.array(data, copy=True).reshape(-1).view(np.uint8)).view(FLOATS[kind]).float()
    from gguf.quants import dequantize as numpy_dequantize
    return torch.from_numpy(np.array(numpy_dequantize(data, kind), dtype=np.float32, copy=True).reshape(-1))
