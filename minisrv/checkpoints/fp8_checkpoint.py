"""An FP8 checkpoint's tensors read as float values: each float8 weight dequantised with its scale (per tensor, per
row or in blocks), to the slice a rank reads; K/V scales collected on the side. The loader then treats them as any
checkpoint's (rounded to the model's dtype, requantised per row by the FP8 layers): one loading path for both."""
from __future__ import annotations

import re
from typing import Dict, Iterator, List, Optional, Tuple

import torch

from .checkpoint import StoredTensor, WeightLoadError
from minisrv.models.fp8 import FP8
from minisrv.models.sharding import Slice

# a weight's scale: block scales (`_inv`, a multiplier despite the name), or per tensor / per row
WEIGHT_SCALE = re.compile(r"^(.*)\.weight_scale(_inv)?$")
KV_SCALE = re.compile(r"^model\.layers\.(\d+)\.self_attn\.([kv])_scale$")


class CheckpointKVScales:
    """Per-layer K/V scales an FP8 checkpoint carries (`self_attn.k_scale` / `v_scale`, vLLM's names)."""

    def __init__(self, num_layers: int) -> None:
        self.k: Dict[int, float] = {}
        self.v: Dict[int, float] = {}
        self.num_layers = num_layers

    def complete(self) -> Optional[Tuple[List[float], List[float]]]:
        """(K scales, V scales) by layer when every layer has both, else None (partial sets are not used)."""
        layers = range(self.num_layers)
        if all(i in self.k and i in self.v for i in layers):
            return [self.k[i] for i in layers], [self.v[i] for i in layers]
        return None


def dequantized_fp8(tensors: Iterator[Tuple[str, StoredTensor]], block: Optional[Tuple[int, int]],
                    kv_scales: CheckpointKVScales) -> Iterator[Tuple[str, StoredTensor]]:
    """The checkpoint's tensors with every float8 weight read as float32 values (its scale applied); scales consumed,
static activation scales dropped (activations are quantised per token), K/V scales handed to `kv_scales`."""
    held = dict(tensors)  # lazy readers: nothing is read yet
    scales: Dict[str, StoredTensor] = {}
    for name in list(held):
        if (m := WEIGHT_SCALE.match(name)) is not None:
            scales[m.group(1) + ".weight"] = held.pop(name)
        elif name.endswith(".input_scale"):
            held.pop(name)
        elif (m := KV_SCALE.match(name)) is not None:  # k or v: the dict of that name
            getattr(kv_scales, m.group(2))[int(m.group(1))] = float(held.pop(name).read(None).float().reshape(-1)[0])
    for name, stored in held.items():
        scale = scales.pop(name, None)
        if scale is None:
            yield name, stored
            continue
        yield name, StoredTensor(stored.shape, lambda piece, w=stored, s=scale, n=name: _dequantize_piece(
            n, w, s, piece, block))
    if scales:
        raise WeightLoadError(f"scale(s) without a weight in the checkpoint: {', '.join(sorted(scales)[:5])}")


def _dequantize_piece(name: str, weight: StoredTensor, scale: StoredTensor, piece: Optional[Slice],
                      block: Optional[Tuple[int, int]]) -> torch.Tensor:
    """float32 values of `piece` of an FP8 weight [R, C] (None: all of it) times its scale: a scalar (per tensor),
    [R] or [R, 1] (per row), or [ceil(R / bh), ceil(C / bw)] with block=(bh, bw)."""
    q = weight.read(piece)
    s = scale.read(None).float()
    if q.dtype != FP8:
        raise WeightLoadError(f"tensor {name!r} has a scale but is {q.dtype}, not float8_e4m3fn")
    q, full = q.float(), weight.shape
    r0 = piece.start if piece is not None and piece.dim == 0 else 0  # where the slice starts in the full tensor
    c0 = piece.start if piece is not None and piece.dim == 1 else 0
    if s.numel() == 1:
        return q * s.reshape(())
    if block is None:
        if s.numel() != full[0]:
            raise WeightLoadError(f"{name!r}: scale of shape {tuple(s.shape)} is neither per tensor nor per row "
                                  f"of {full}")
        return q * s.reshape(-1)[r0:r0 + q.shape[0], None]
    want = tuple(-(-n // b) for n, b in zip(full, block))
    if tuple(s.shape) != want:
        raise WeightLoadError(f"{name!r}: block scales of shape {tuple(s.shape)}, expected {want} for "
                              f"{full} in blocks of {block}")
    rows = torch.arange(r0, r0 + q.shape[0]) // block[0]
    cols = torch.arange(c0, c0 + q.shape[1]) // block[1]
    return q * s[rows][:, cols]
