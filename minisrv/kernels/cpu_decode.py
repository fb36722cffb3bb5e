"""A decode step's decoder layers in one C call on the CPU (cpu_decode.c), for a dense Llama-style model whose
projections are kept in GGUF blocks: the kernels the layers call one by one, without the Python and torch calls
between them (at one sequence those took as long as the arithmetic). The model uses it where `takes` says so and
runs its layers in Python otherwise; both give the same numbers (tests/test_cpu_decode.py). A CPU decode step's
attention metadata (`DecodeMeta`) is defined here, so that the paged attention that builds it and the model's layers
that read it share one type."""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

import torch

from .cpu_blocks import MAX_ROWS
from .cpu_build import FLOAT, I64, INT, PTR, CompiledKernels, c_function


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", PTR), ("post_norm", PTR), ("qkv", PTR), ("o", PTR), ("gate_up", PTR), ("down", PTR),
                ("qkv_l", PTR), ("o_l", PTR), ("gate_up_l", PTR), ("down_l", PTR), ("k", PTR), ("v", PTR)]


class _Shape(ctypes.Structure):
    _fields_ = [("layers", INT), ("hidden", INT), ("hq", INT), ("hkv", INT), ("d", INT), ("inter", INT),
                ("eps", FLOAT), ("scale", FLOAT), ("kv_stride", I64), ("window", INT)]


@dataclass(frozen=True)
class DecodeMeta:
    """A decode step over the paged pool on the CPU (attention/cpu_paged.py plans it): what its attention reads,
    and what the layers in one call read too."""

    loc: torch.Tensor  # [B] slots this step's k/v go to
    rows: torch.Tensor  # [B] int64 rows of the request->token table
    kv_lens: torch.Tensor  # [B] int32 keys of each request, this step's included
    k: List[torch.Tensor]  # the pool's per-layer [slots, Hkv, D] views
    v: List[torch.Tensor]
    req_to_token: torch.Tensor
    scale: float
    window: int = 0  # every layer's sliding window (0: none); the layers in one call serve only such models


class DecodeLayersKernel(CompiledKernels):
    """The compiled call (`DecodeLayersKernel.load()`; None where it cannot be built) and, per pool, the layer table
    it reads (built on first use: the pool is the engine's, the weights the model's)."""

    SOURCE = "cpu_decode"

    def __init__(self, lib: ctypes.CDLL, how: str) -> None:
        self.how = how
        self.fn = c_function(lib, "decode_layers_f32", INT, PTR, PTR, PTR, PTR, PTR, INT, PTR, PTR, PTR, PTR, I64,
                             PTR, PTR, INT, PTR, PTR)
        self._table: Optional[Tuple[int, Any, _Shape, List[Any]]] = None

    @staticmethod
    def takes(x: torch.Tensor) -> bool:
        return 0 < x.shape[0] <= MAX_ROWS and x.dtype == torch.float32

    def _layers(self, layers: Any, meta: DecodeMeta) -> Tuple[Any, _Shape]:
        key = meta.k[0].data_ptr()
        if self._table is None or self._table[0] != key:
            first = layers[0]
            att, mlp = first.self_attn, first.mlp
            table = (_Layer * len(layers))()
            for i, layer in enumerate(layers):
                projs = (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
                table[i] = _Layer(layer.input_layernorm.weight.data_ptr(),
                                  layer.post_attention_layernorm.weight.data_ptr(),
                                  *(p.packed.data_ptr() for p in projs), *(p.layouts.data_ptr() for p in projs),
                                  meta.k[i].data_ptr(), meta.v[i].data_ptr())
            shape = _Shape(len(layers), att.o_proj.out_features, att.hq, att.hkv, att.d,
                           mlp.down_proj.in_features, first.input_layernorm.eps, meta.scale,
                           meta.k[0].stride(0), meta.window)
            self._table = (key, table, shape, [meta.k, meta.v])  # the views stay referenced with the table
        return self._table[1], self._table[2]

    def __call__(self, layers: Any, x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                 meta: DecodeMeta, aux_layer_ids: Sequence[int] = (),
                 aux: Optional[List[torch.Tensor]] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """Run every layer on x [m, hidden] (the embedding; overwritten): (the last layer's output, the residual
        stream), which the model's final add + norm takes. aux: gets the residual stream entering each layer of
        aux_layer_ids appended ([m, hidden] each), as llama.DecoderLayers does."""
        table, shape = self._layers(layers, meta)
        m = x.shape[0]
        x = x.contiguous()
        residual = torch.empty_like(x)
        width = (shape.hq + 2 * shape.hkv) * shape.d + shape.hq * shape.d + 3 * shape.inter
        scratch = torch.empty(m * width, dtype=torch.float32)
        pos = positions.to(torch.int64).contiguous()
        loc = meta.loc.to(torch.int64).contiguous()
        rows, kv_lens = meta.rows.contiguous(), meta.kv_lens.contiguous()
        ids = sorted(aux_layer_ids) if aux is not None else []
        layer_ids, read = None, None  # a plain decode step reads no layer (null pointers)
        if ids:
            layer_ids = torch.tensor(ids, dtype=torch.int32)
            read = torch.empty(m, len(ids), x.shape[1], dtype=torch.float32)
        rc = self.fn(table, ctypes.byref(shape), x.data_ptr(), residual.data_ptr(), scratch.data_ptr(), m,
                     pos.data_ptr(), loc.data_ptr(), cos_sin.data_ptr(), meta.req_to_token.data_ptr(),
                     meta.req_to_token.stride(0), rows.data_ptr(), kv_lens.data_ptr(), len(ids),
                     layer_ids.data_ptr() if ids else None, read.data_ptr() if ids else None)
        if rc != 0:
            raise MemoryError("decode attention could not allocate its scratch memory")
        if ids:
            aux.extend(read[:, j] for j in range(len(ids)))
        return x, residual
