"""Layers over a GGUF model's weights kept in their blocks on the CPU (gguf_blocks.py, kernels/cpu_blocks.py): the
projections (BlockLinear) and the token embedding, which doubles as a tied LM head (BlockEmbedding). Each holds one
parameter, `packed`, the kernels' records, and a buffer, `layouts`, their layout byte per group of 4 rows (a fused
projection may join tensors of different types); the loader writes both from the checkpoint's blocks (load_rows)
under the HF name of the matrix it replaces (`<module>.weight`)."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .gguf_blocks import GGUFBlocks, packed_shape


class BlockLinear(nn.Module):
    """y = x W^T (+ bias) with W [out_features, in_features] in blocks."""

    def __init__(self, in_features: int, out_features: int, bias: bool, kernels: Any) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.packed = nn.Parameter(torch.empty(packed_shape(out_features, in_features), dtype=torch.uint8),
                                   requires_grad=False)
        self.register_buffer("layouts", torch.zeros(out_features // 4, dtype=torch.uint8))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.kernels = kernels

    def project(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        y = self.kernels.matmul(x.reshape(-1, self.in_features), self.packed, self.layouts, self.out_features,
                               self.in_features)
        if self.bias is not None:
            y += self.bias
        return y.reshape(*lead, self.out_features)

    forward = project

    def load_rows(self, row: int, w: Any) -> None:
        """Rows [row, row + len(w)) of W from the checkpoint's blocks (a fused projection is written in parts)."""
        if not isinstance(w, GGUFBlocks):
            raise ValueError("a block layer is loaded from a GGUF tensor's blocks only")
        rows = w.shape[0]
        if row % 4 or rows % 4:
            raise ValueError(f"block rows {row}..{row + rows} do not fall on groups of 4")
        w.pack_into(self.packed.data[row // 4:(row + rows) // 4], self.layouts[row // 4:(row + rows) // 4],
                    self.kernels)


class BlockEmbedding(BlockLinear):
    """The token embedding [vocab, hidden] in blocks: forward looks rows up, project() is the tied LM head."""

    def __init__(self, rows: int, hidden: int, kernels: Any) -> None:
        super().__init__(hidden, rows, False, kernels)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.kernels.rows(self.packed, self.layouts, ids, self.in_features).reshape(*ids.shape, self.in_features)


def block_kernels(ops: Any) -> Any:
    """The CPU ops' block kernels (ops: the model's layer_ops.LayerOps), which a model loaded in blocks needs
    (gguf_blocks.blocks_unavailable_here checked)."""
    kernels = ops.block_kernels
    if kernels is None:
        raise ValueError("a GGUF model in blocks needs the CPU's block kernels (kernels/cpu_blocks.c)")
    return kernels
