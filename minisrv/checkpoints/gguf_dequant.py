"""GGUF tensors dequantised with vectorised torch for Q4_0, Q4_1, Q8_0 and the float types (gguf's numpy path takes
about three times the CPU time, on every start without a cached model); other types go to gguf's own. The arithmetic
is gguf's, operation for operation, so the values are the same to the bit (tests/test_startup.py checks them)."""
from __future__ import annotations

from typing import Any, Callable, Dict

import numpy as np
import torch
from gguf.constants import GGMLQuantizationType as Q

from minisrv.models.gguf_repack import f16, nibbles


def raw_blocks(data: Any, block_bytes: int) -> torch.Tensor:
    """The tensor's bytes as [blocks, block_bytes] uint8 (a copy: the file's memory map is read-only)."""
    return torch.from_numpy(np.array(data, dtype=np.uint8, copy=True).reshape(-1, block_bytes))


def _q4_0(data: Any) -> torch.Tensor:
    b = raw_blocks(data, 18)
    return (f16(b, 0) * (nibbles(b[:, 2:]).to(torch.int8) - 8).float()).reshape(-1)


def _q4_1(data: Any) -> torch.Tensor:
    b = raw_blocks(data, 20)
    return (f16(b, 0) * nibbles(b[:, 4:]).float() + f16(b, 2)).reshape(-1)


def _q8_0(data: Any) -> torch.Tensor:
    b = raw_blocks(data, 34)
    return (f16(b, 0) * b[:, 2:].contiguous().view(torch.int8).float()).reshape(-1)


def _float(dtype: torch.dtype) -> Callable[[Any], torch.Tensor]:
    def read(data: Any) -> torch.Tensor:
        raw = torch.from_numpy(np.array(data, copy=True).reshape(-1).view(np.uint8))
        return raw.view(dtype).float()
    return read


TORCH_DEQUANTIZERS: Dict[int, Callable[[Any], torch.Tensor]] = {
    Q.Q4_0: _q4_0, Q.Q4_1: _q4_1, Q.Q8_0: _q8_0,
    Q.F32: _float(torch.float32), Q.F16: _float(torch.float16), Q.BF16: _float(torch.bfloat16),
}


def dequantize(data: Any, kind: Q) -> torch.Tensor:
    """A tensor's data (gguf's reader gives a numpy view of its bytes) as float32, flat."""
    fast = TORCH_DEQUANTIZERS.get(kind)
    if fast is not None:
        return fast(data)
    from gguf.quants import dequantize as numpy_dequantize
    return torch.from_numpy(np.array(numpy_dequantize(data, kind), dtype=np.float32, copy=True).reshape(-1))
