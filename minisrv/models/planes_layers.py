"""Layers over a GGUF model's weights kept in their blocks on the GPU (gguf_planes.py): the projections and LM head
(PlanesLinear) and the token embedding, which doubles as a tied head (PlanesEmbedding).

A layer's planes are made as the loader hands it each checkpoint tensor's blocks (load_rows), on the device of its
`device_probe` (an empty buffer the loader places with the model), because a tensor's block type is known only then:
a fused projection may join types (a Q4_K_M file's attn_v and ffn_down are Q6_K in some layers, their neighbours
Q4_K). Consecutive rows of one type share one set of planes (one GEMM); the rest run one GEMM each, written into
their columns of the output."""
from __future__ import annotations

from typing import Any, List, Optional, Tuple

import torch
from torch import nn

from minisrv.distributed import TensorParallel
from minisrv.kernels.w4a16_gemm import BlockPlanes, dequantize_planes, w4a16_gemm

from .gguf_blocks import GGUFBlocks
from .gguf_planes import to_planes

PLANE_NAMES = BlockPlanes._fields[1:]


class PlanesLinear(nn.Module):
    """y = x W^T (+ bias) with W [out_features, in_features] in GGUF blocks, as planes: `parts` lists (first output
    row, planes) of each run of rows of one block type."""

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.register_buffer("device_probe", torch.empty(0), persistent=False)
        self.parts: List[Tuple[int, BlockPlanes]] = []

    def load_rows(self, row: int, w: Any) -> None:
        """Rows [row, row + len(w)) of W from the checkpoint's blocks (a fused projection is written in parts)."""
        if not isinstance(w, GGUFBlocks):
            raise ValueError("a GGUF layer is loaded from a GGUF tensor's blocks only")
        planes = to_planes(w.data, w.kind, w.rows, w.cols, w.src_rows, self.device_probe.device)
        parts: List[Tuple[int, BlockPlanes]] = []
        for start, p in sorted(self.parts + [(row, planes)], key=lambda part: part[0]):
            if parts and parts[-1][1].fmt == p.fmt and parts[-1][0] + parts[-1][1].low.shape[1] == start:
                first, prev = parts.pop()  # adjacent rows of one type: one set of planes
                start, p = first, BlockPlanes(p.fmt, *(torch.cat([a, b], dim=1) if a is not None else None
                                                       for a, b in zip(prev[1:], p[1:])))
            parts.append((start, p))
        for name in [n for n in self._parameters if n.startswith("part")]:
            del self._parameters[name]
        self.parts = [(start, BlockPlanes(p.fmt, *(self._hold(f"part{i}_{name}", t)
                                                   for name, t in zip(PLANE_NAMES, p[1:]))))
                      for i, (start, p) in enumerate(parts)]

    def _hold(self, name: str, t: Optional[torch.Tensor]) -> Optional[nn.Parameter]:
        """A plane as a parameter (so that it counts as a weight and moves with the module), or None."""
        if t is None:
            return None
        self.register_parameter(name, nn.Parameter(t, requires_grad=False))
        return self._parameters[name]

    def project(self, x: torch.Tensor) -> torch.Tensor:
        lead, x2 = x.shape[:-1], x.reshape(-1, self.in_features)
        run = w4a16_gemm() if x2.is_cuda and x2.dtype in (torch.bfloat16, torch.float16) and x2.shape[0] else None
        x2 = x2 if x2.stride(-1) == 1 or run is None else x2.contiguous()
        covered = sum(p.low.shape[1] for _, p in self.parts)
        if len(self.parts) == 1 and covered == self.out_features:
            y = run(x2, self.parts[0][1]) if run is not None else x2 @ dequantize_planes(self.parts[0][1]).to(x2.dtype)
        else:
            y = x2.new_empty(x2.shape[0], self.out_features)
            if covered < self.out_features:  # rows no part covers: the vocabulary's padding
                y.zero_()
            for row, p in self.parts:
                out = y[:, row:row + p.low.shape[1]]
                if run is not None:
                    run(x2, p, out=out)
                else:
                    out.copy_(x2 @ dequantize_planes(p).to(x2.dtype))
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*lead, self.out_features)

    forward = project

    def extra_repr(self) -> str:
        kinds = ", ".join(f"rows {row}+{p.low.shape[1]}: {p.fmt}" for row, p in self.parts)
        return f"in_features={self.in_features}, out_features={self.out_features}, {kinds or 'not loaded'}"


class PlanesEmbedding(PlanesLinear):
    """The token embedding over this rank's rows of the vocabulary [start, start + rows) in GGUF blocks, as planes:
    forward dequantises the rows looked up (layers.VocabEmbedding's split), project() is the tied LM head."""

    def __init__(self, rows: int, hidden: int, start: int, tp: TensorParallel) -> None:
        super().__init__(hidden, rows, False)
        self.start, self.tp = start, tp
        self.dtype = torch.get_default_dtype()  # the model's (it is built under it)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if len(self.parts) != 1:
            raise ValueError("a GGUF embedding is one tensor of one block type")
        planes = self.parts[0][1]

        def lookup(local: torch.Tensor) -> torch.Tensor:
            # (contiguous: the kernels after the embedding, a GPU norm's above all, take rows of unit stride)
            rows = dequantize_planes(planes.columns(local.reshape(-1))).to(self.dtype).t().contiguous()
            return rows.reshape(*local.shape, self.in_features)
        return self.tp.embed_rows(ids, self.start, planes.low.shape[1], lookup)
