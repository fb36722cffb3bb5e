"""gpt-oss's experts as the loader reads every other mixture's: one tensor per expert and projection.

gpt-oss checkpoints stack a layer's experts, in one of two layouts:
- transformers' own (`save_pretrained`, fine-tunes): `experts.gate_up_proj` [E, H, 2I], the gate's and the up's
  columns interleaved (gate 2j, up 2j + 1), with `gate_up_proj_bias` [E, 2I] interleaved alike, and
  `experts.down_proj` [E, I, H] with `down_proj_bias` [E, H]: each the transpose of a Linear's weight;
- the hub's MXFP4 (kernels/moe_w4a16.py's layout): `gate_up_proj_blocks` [E, 2I, H/32, 16] and `_scales`
  [E, 2I, H/32], rows of W interleaved the same way, `down_proj_blocks` [E, H, I/32, 16] and `_scales`, and the
  biases as above in bf16.
Each is read here as `<experts>.<e>.gate_proj.weight` [I, H], `up_proj` and `down_proj.weight` [H, I] (and their
`.bias`), so that the loader's per-expert targets, tensor-parallel slices and shape checks apply unchanged: a rank
reads its own rows (or down's columns, in whole 32s for MXFP4) of one expert at a time. MXFP4 rows are dequantised
to float32 (exact) unless they are kept: then a reader returns the rows' (bytes [n, K/2], exponents [n, K/32]),
which moe.Experts("mxfp4") stores as they are.
"""
from __future__ import annotations

import re
from typing import Any, Dict, Iterator, Optional, Tuple

import torch

from minisrv.kernels.moe_w4a16 import mxfp4_dequantize
from minisrv.models.sharding import Slice

from .checkpoint import StoredTensor, WeightLoadError

STACKED = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)(_bias|_blocks|_scales)?$")
PARTS = {"gate_up_proj": (("gate_proj", 0), ("up_proj", 1)), "down_proj": (("down_proj", None),)}


def gpt_oss_experts(tensors: Iterator[Tuple[str, StoredTensor]],
                    keep_mxfp4: bool) -> Iterator[Tuple[str, StoredTensor]]:
    """The checkpoint's tensors with each stacked expert tensor as its per-expert ones (the module docstring);
    keep_mxfp4: MXFP4 rows read as (bytes, exponents) rather than dequantised."""
    pending: Dict[Tuple[str, str], Dict[str, StoredTensor]] = {}
    for name, stored in tensors:
        m = STACKED.match(name)
        if m is None:
            yield name, stored
            continue
        owner, proj, part = m.group(1), m.group(2), m.group(3) or ""
        if part in ("_blocks", "_scales"):  # read once both halves are here
            got = pending.setdefault((owner, proj), {})
            got[part] = stored
            if len(got) == 2:
                yield from _mxfp4(owner, proj, got.pop("_blocks"), got.pop("_scales"), keep_mxfp4)
                del pending[(owner, proj)]
            continue
        yield from _per_expert(owner, proj, part, stored)
    for (owner, proj), got in pending.items():
        raise WeightLoadError(f"{owner}.{proj}{next(iter(got))} has no {'_scales' if '_blocks' in got else '_blocks'}")


def _per_expert(owner: str, proj: str, part: str, stored: StoredTensor) -> Iterator[Tuple[str, StoredTensor]]:
    """transformers' layout: [E, K, N] weights (N interleaved for gate_up) or [E, N] biases."""
    bias = part == "_bias"
    if len(stored.shape) != (2 if bias else 3):
        raise WeightLoadError(f"{owner}.{proj}{part} has shape {tuple(stored.shape)}")
    for e in range(stored.shape[0]):
        for sub, parity in PARTS[proj]:
            def read(piece: Optional[Slice], e: int = e, parity: Optional[int] = parity) -> torch.Tensor:
                t = stored.read(Slice(0, e, 1))[0]
                t = t if parity is None else t[..., parity::2]
                t = t if bias else t.t()
                return t if piece is None else t.narrow(piece.dim, piece.start, piece.length)
            n = stored.shape[-1] // (1 if parity is None else 2)
            shape = (n,) if bias else (n, stored.shape[1])
            yield f"{owner}.{e}.{sub}.{'bias' if bias else 'weight'}", StoredTensor(shape, read)


def _mxfp4(owner: str, proj: str, blocks: StoredTensor, scales: StoredTensor,
           keep: bool) -> Iterator[Tuple[str, StoredTensor]]:
    """The hub's layout: blocks [E, N, K/32, 16] and scales [E, N, K/32], N interleaved for gate_up."""
    e_n_g = tuple(blocks.shape[:3])
    if len(blocks.shape) != 4 or blocks.shape[3] != 16 or tuple(scales.shape) != e_n_g:
        raise WeightLoadError(f"{owner}.{proj}: MXFP4 blocks {tuple(blocks.shape)} and scales "
                              f"{tuple(scales.shape)}; expected [E, N, K/32, 16] and [E, N, K/32]")
    for e in range(e_n_g[0]):
        for sub, parity in PARTS[proj]:
            def read(piece: Optional[Slice], e: int = e, parity: Optional[int] = parity) -> Any:
                b, s = blocks.read(Slice(0, e, 1))[0], scales.read(Slice(0, e, 1))[0]
                if parity is not None:
                    b, s = b[parity::2], s[parity::2]
                if piece is not None and piece.dim == 0:
                    b, s = b.narrow(0, piece.start, piece.length), s.narrow(0, piece.start, piece.length)
                elif piece is not None:  # columns, in whole blocks of 32
                    if piece.start % 32 or piece.length % 32:
                        raise WeightLoadError(f"{owner}.{e}.{sub}: a rank's columns {piece.start}.."
                                              f"{piece.start + piece.length} are not whole MXFP4 blocks of 32")
                    b, s = b.narrow(1, piece.start // 32, piece.length // 32), s.narrow(1, piece.start // 32,
                                                                                       piece.length // 32)
                b = b.reshape(b.shape[0], -1)
                return (b, s) if keep else mxfp4_dequantize(b, s)
            n = e_n_g[1] // (1 if parity is None else 2)
            yield f"{owner}.{e}.{sub}.weight", StoredTensor((n, e_n_g[2] * 32), read)
