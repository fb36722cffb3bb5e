"""A GGUF model's projections and embedding kept in their 32-wide blocks on the CPU (kernels/cpu_blocks.c), instead
of dequantised to float32: a third of the memory and of the bytes a decode step reads, the same weight values.

Q4_0, Q4_1 and Q8_0 blocks all read as w = d * q + m with q a byte and (d, m) one float32 pair per 32 weights (Q4_0:
q in 0..15, m = -8 d; Q8_0: q + 128, m = -128 d). d * q and m are exact in float32 and d * q + m rounds once, as
gguf's own dequantiser does: the packed weights dequantise to the float32 path's values, to the bit. The kernels
pack those three in C; Q5_0, Q5_1 and the k-quants Q4_K, Q5_K and Q6_K (a Q4_K_M file's mix) are repacked in torch
(gguf_repack.py), Q6_K's 16-weight sub-blocks into records of their own layout.

`blocks_unavailable_here` and `blocks_unavailable_in` say why a model cannot load this way (it is then dequantised).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np
import torch
from gguf.constants import GGML_QUANT_SIZES
from gguf.constants import GGMLQuantizationType as Q

from minisrv.kernels.cpu_blocks import RECORD_BYTES

from .args import ModelArgs
from .gguf_planes import PLANE_FORMATS
from .gguf_repack import REPACKERS, repack

BLOCK = 32
PACKED_IN_C = (Q.Q4_0, Q.Q4_1, Q.Q8_0)  # kernels/cpu_blocks.c's blocks_pack; the rest: gguf_repack.py
BLOCK_TYPES = {t: t.name for t in (*PACKED_IN_C, *REPACKERS)}


def is_block_matrix(hf_name: str) -> bool:
    """Whether a checkpoint tensor (HF name) is one of the matrices kept in blocks: projections, embedding, head."""
    return hf_name.endswith("_proj.weight") or hf_name in ("model.embed_tokens.weight", "lm_head.weight")


@dataclass
class GGUFBlocks:
    """One tensor's blocks as the loader hands them to the layers: the file's bytes of a matrix (gguf's reader's
    view, not read yet), its block type, its shape [rows, cols], and the file's row each row comes from (None: in
    order, all of the file's rows)."""

    data: Any
    kind: Q
    rows: int
    cols: int
    src_rows: Optional[torch.Tensor] = None

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.rows, self.cols))

    def take_rows(self, index: torch.Tensor) -> "GGUFBlocks":
        src = index if self.src_rows is None else self.src_rows[index]
        return GGUFBlocks(self.data, self.kind, len(index), self.cols, src)

    def narrow(self, dim: int, start: int, length: int) -> "GGUFBlocks":
        """Rows (dim 0: one part of a fused matrix, as a phi3 file's attn_qkv and ffn_up, or a tensor-parallel
        rank's share) or columns (dim 1, whole blocks only: a rank's share of K) [start, start + length)."""
        if dim == 0:
            return self.take_rows(torch.arange(start, start + length))
        per, size = GGML_QUANT_SIZES[Q(int(self.kind))]
        if start % per or length % per:
            raise ValueError(f"columns {start}..{start + length} of a {Q(int(self.kind)).name} matrix split its "
                             f"{per}-weight blocks: choose a tp size that gives each rank whole blocks")
        raw = np.asarray(self.data, dtype=np.uint8).reshape(-1, self.cols // per * size)
        return GGUFBlocks(raw[:, start // per * size:(start + length) // per * size], self.kind, self.rows, length,
                          self.src_rows)

    def pack_into(self, out: torch.Tensor, layouts: torch.Tensor, kernels: Any) -> None:
        """Writes the kernels' records of the matrix into out ([rows / 4, cols / 32, 160] uint8) and their layout
        bytes into layouts ([rows / 4] uint8)."""
        if self.kind in PACKED_IN_C:
            kernels.pack(self.data, int(self.kind), self.src_rows, out)
            layouts.zero_()
        else:
            repack(self.data, self.kind, self.src_rows, out, layouts)


def packed_shape(rows: int, cols: int) -> tuple:
    return (rows // 4, cols // BLOCK, RECORD_BYTES)


def blocks_unavailable_here(args: ModelArgs, device: torch.device, dtype: torch.dtype, tp_enabled: bool,
                            quantization: Optional[str], kernels: Optional[Any]) -> Optional[str]:
    """Why no GGUF model can keep its blocks in this setting, or None if one can (the file is checked apart). On
    CUDA `kernels` is the W4A16 GEMM's launcher (planes_layers.py), on the CPU the block kernels."""
    gpu = device.type == "cuda"
    if not gpu and device.type != "cpu":
        return "blocks are kept on the CPU and on CUDA"
    if gpu and dtype not in (torch.bfloat16, torch.float16):
        return f"the model runs in {dtype}, the GPU's block kernel takes 16-bit activations"
    if not gpu and dtype != torch.float32:
        return f"the model runs in {dtype}, the block kernels compute in float32"
    if quantization is not None:
        return f"--quantization {quantization}"
    if tp_enabled and not gpu:  # (planes are split between ranks as any weight is)
        return "tensor parallelism"
    if args.num_experts:  # (a GGUF's experts are in its config: gguf_file.moe_config)
        return "a mixture of experts"
    if kernels is None:
        return "Triton is missing" if gpu else "the block kernels did not build"
    return None


def blocks_unavailable_in(reader: Any, hf_name: Callable[[str], str], gpu: bool = False) -> Optional[str]:
    """Why this GGUF file's matrices cannot be kept in blocks (on the GPU: as planes), or None if they can.
    hf_name: a tensor's HF name by its GGUF name (gguf_file.hf_name)."""
    types = {t: Q(t).name for t in PLANE_FORMATS} if gpu else BLOCK_TYPES
    for t in reader.tensors:
        if not is_block_matrix(hf_name(t.name)):
            continue
        rows = int(t.shape[-1])
        if t.tensor_type not in types:
            return f"{t.name} is {t.tensor_type.name} (blocks are kept for {', '.join(types.values())})"
        if rows % 4 and not gpu:
            return f"{t.name} has {rows} rows (a multiple of 4 is needed)"
    return None
