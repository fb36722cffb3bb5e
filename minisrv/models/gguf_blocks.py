"""A GGUF model's projections and embedding kept in their 32-wide blocks on the CPU (kernels/cpu_blocks.c), instead
of dequantised to float32: a third of the memory and of the bytes a decode step reads, the same weight values.

Q4_0, Q4_1 and Q8_0 blocks all read as w = d * q + m with q a byte and (d, m) one float32 pair per 32 weights (Q4_0:
q in 0..15, m = -8 d; Q8_0: q + 128, m = -128 d). d * q and m are exact in float32 and d * q + m rounds once, as
gguf's own dequantiser does: the packed weights dequantise to the float32 path's values, to the bit.

`blocks_unavailable_here` and `blocks_unavailable_in` say why a model cannot load this way (then it is dequantised as before); `GGUFBlocks` is one
tensor's blocks as the loader hands them to the layers (block_layers.py), `pack` lays them out for the kernels.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from gguf.constants import GGMLQuantizationType as Q

from .args import ModelArgs
from .gguf_dequant import block_scale, nibbles, raw_blocks

BLOCK = 32
RECORD_BYTES = 160  # kernels/cpu_blocks.py's: 4 rows x 32 columns, float32 d[4], m[4], then uint8 q[4][32]
BLOCK_TYPES = {Q.Q4_0: "Q4_0", Q.Q4_1: "Q4_1", Q.Q8_0: "Q8_0"}


def is_block_matrix(hf_name: str) -> bool:
    """Whether a checkpoint tensor (HF name) is one of the matrices kept in blocks: projections, embedding, head."""
    return hf_name.endswith("_proj.weight") or hf_name in ("model.embed_tokens.weight", "lm_head.weight")


@dataclass
class GGUFBlocks:
    """A [rows, cols] matrix as bytes q [rows, cols] and float32 d, m [rows, cols / 32]: w = d * q + m."""

    q: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    @classmethod
    def read(cls, data: Any, kind: Q, rows: int, cols: int) -> "GGUFBlocks":
        """From a tensor's raw bytes (gguf's reader gives a numpy view of them), in the file's block type."""
        if kind == Q.Q8_0:
            b = raw_blocks(data, 34)
            d = block_scale(b, 0)
            q = (b[:, 2:].contiguous().view(torch.int8).to(torch.int16) + 128).to(torch.uint8)
            m = d * -128.0
        elif kind in (Q.Q4_0, Q.Q4_1):
            b = raw_blocks(data, 18 if kind == Q.Q4_0 else 20)
            d = block_scale(b, 0)
            q = nibbles(b[:, 2:] if kind == Q.Q4_0 else b[:, 4:])
            m = d * -8.0 if kind == Q.Q4_0 else block_scale(b, 2)
        else:
            raise ValueError(f"no block form for GGUF type {kind!r}")
        return cls(q.reshape(rows, cols), d.reshape(rows, cols // BLOCK), m.reshape(rows, cols // BLOCK))

    def take_rows(self, index: torch.Tensor) -> "GGUFBlocks":
        return GGUFBlocks(self.q[index], self.d[index], self.m[index])

    def dequantize(self) -> torch.Tensor:
        """The float32 matrix (what the dequantising path loads)."""
        return self.d.repeat_interleave(BLOCK, 1) * self.q.float() + self.m.repeat_interleave(BLOCK, 1)


def pack(w: GGUFBlocks) -> torch.Tensor:
    """Records [rows / 4, cols / 32, 160] uint8 (kernels/cpu_blocks.c's layout) of a matrix with rows % 4 == 0."""
    rows, cols = w.shape
    g, nb = rows // 4, cols // BLOCK
    q = w.q.reshape(g, 4, nb, BLOCK).permute(0, 2, 1, 3).reshape(g, nb, 4 * BLOCK)
    dm = torch.cat([w.d.reshape(g, 4, nb).permute(0, 2, 1), w.m.reshape(g, 4, nb).permute(0, 2, 1)], dim=-1)
    return torch.cat([dm.contiguous().view(torch.uint8), q], dim=-1).contiguous()


def packed_shape(rows: int, cols: int) -> tuple:
    return (rows // 4, cols // BLOCK, RECORD_BYTES)


def blocks_unavailable_here(args: ModelArgs, device: torch.device, dtype: torch.dtype, tp_enabled: bool,
                            quantization: Optional[str], kernels: Optional[Any]) -> Optional[str]:
    """Why no GGUF model can keep its blocks in this setting, or None if one can (the file is checked apart)."""
    if device.type != "cpu":
        return "the block kernels are the CPU's"
    if dtype != torch.float32:
        return f"the model runs in {dtype}, the block kernels compute in float32"
    if quantization is not None:
        return f"--quantization {quantization}"
    if tp_enabled:
        return "tensor parallelism"
    if args.num_experts:  # (a GGUF's experts are in its config: gguf_file.moe_config)
        return "a mixture of experts"
    if kernels is None:
        return "the block kernels did not build"
    return None


def blocks_unavailable_in(reader: Any, hf_name: Callable[[str], str]) -> Optional[str]:
    """Why this GGUF file's matrices cannot be kept in blocks, or None if they can. hf_name: a tensor's HF name by
    its GGUF name (gguf_file.hf_name)."""
    for t in reader.tensors:
        if not is_block_matrix(hf_name(t.name)):
            continue
        rows = int(t.shape[-1])
        if t.tensor_type not in BLOCK_TYPES:
            return f"{t.name} is {t.tensor_type.name} (blocks are kept for {', '.join(BLOCK_TYPES.values())})"
        if rows % 4:
            return f"{t.name} has {rows} rows (a multiple of 4 is needed)"
    return None
