"""The attention interface: a backend plans once per step (`prepare`), every layer calls `forward`.

The model runner builds one `ForwardBatch` per step; the backend turns it into whatever metadata its kernels
want (padded index tables, page tables, FlashInfer plans) exactly once, and every layer reuses it.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Sequence, Tuple

import torch

from minisrv.batch import ForwardBatch
from minisrv.models.attention_options import LayerAttention, plain_layers

if TYPE_CHECKING:
    from minisrv.kvcache import KVPool


class AttentionBackend(ABC):
    """One backend serves every layer of one model over one KV pool.

    A step's metadata is a value: `prepare` returns it and every layer's `forward` takes it, so nothing about a step
    lives on the backend between calls (two steps can be in flight at once under overlap scheduling). `layers`: each
    layer's window, scale and soft-cap (models/attention_options.py; None: plain causal attention everywhere); the
    registry creates a backend only for a model whose features it serves.
    """

    name: str = "base"

    def __init__(self, pool: "KVPool", req_to_token: torch.Tensor, num_q_heads: int,
                 layers: Optional[Sequence[LayerAttention]] = None) -> None:
        self.pool = pool
        self.req_to_token = req_to_token  # [max_rows, max_context] int32: (row, position) -> slot
        self.num_q_heads = num_q_heads
        self.num_kv_heads = pool.num_kv_heads
        self.head_dim = pool.head_dim
        self.page_size = pool.page_size
        self.device = req_to_token.device
        self.layers = tuple(layers) if layers is not None else plain_layers(pool.num_layers, self.head_dim)
        if len(self.layers) != pool.num_layers:
            raise ValueError(f"{len(self.layers)} layers' attention options for a pool of {pool.num_layers} layers")

    @abstractmethod
    def prepare(self, batch: ForwardBatch) -> Any:
        """This step's metadata, built once per step before the model runs."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k: Optional[torch.Tensor], v: Optional[torch.Tensor], layer_id: int,
                meta: Any) -> torch.Tensor:
        """q: [T, Hq, D], k/v: [T, Hkv, D] (rotated already). Stores k/v at the step's slots, returns the attention
        output [T, Hq, D]. k = v = None: the caller has stored them already, where kv_store_target allowed it."""

    def kv_store_target(self, layer_id: int, meta: Any) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
        """(the pool's [2, ..., Hkv, D] tensor of this layer, the step's slots) where a caller may store the new
        k/v itself and hand forward None for them (kernels/qk_rope_store.py stores them as it rotates k); None where
        this backend stores them (the default), or where the pool holds another dtype than the model's (FP8)."""
        return None

    def _pool_target(self, layer_id: int, slots: torch.Tensor) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
        """kv_store_target for a backend that only ever reads the pool (its forward stores k/v first)."""
        return None if self.pool.quantized else (self.pool.kv[layer_id], slots)

    def step(self, batch: ForwardBatch) -> "AttentionStep":
        return AttentionStep(self, self.prepare(batch))

    # CUDA-graph hooks (decode only). A backend that cannot be captured leaves supports_cuda_graph False.
    supports_cuda_graph: bool = False
    # Whether decode steps with `ForwardBatch.prefix_groups` set run as cascade attention (attention/cascade.py);
    # the model runner plans groups only for a backend that says so.
    supports_cascade: bool = False

    def init_cascade_state(self) -> None:
        """Make (and load the kernels of) what cascade steps use, at start-up rather than in the first one."""
        raise NotImplementedError(f"{self.name} has no cascade decode")

    def init_graph_state(self, max_bs: int, max_seq_len: int) -> None:
        raise NotImplementedError(f"{self.name} does not support CUDA graphs")

    def verify_backend(self) -> Optional["AttentionBackend"]:
        """The backend whose `verify_meta` runs verify steps of one query length per request in CUDA graphs
        (engine/cuda_graph.py), or None: they run eagerly as extend steps."""
        return None

    def prepare_for_capture(self, batch: ForwardBatch) -> Any:
        """Metadata over the backend's static buffers for a graph of batch.batch_size rows; kept for its replays."""
        raise NotImplementedError

    def prepare_for_replay(self, batch: ForwardBatch, padded_bs: int, meta: Any) -> None:
        """Rewrite the static buffers behind `meta` (from prepare_for_capture(padded_bs)) for this batch."""
        raise NotImplementedError


@dataclass(frozen=True)
class AttentionStep:
    """What a model's attention layers get for one step: the backend and that step's metadata."""

    backend: AttentionBackend
    meta: Any

    def __call__(self, q: torch.Tensor, k: Optional[torch.Tensor], v: Optional[torch.Tensor],
                 layer_id: int) -> torch.Tensor:
        return self.backend.forward(q, k, v, layer_id, self.meta)

    def kv_store_target(self, layer_id: int) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
        return self.backend.kv_store_target(layer_id, self.meta)


class HybridBackend(AttentionBackend):
    """Prefill and extend on one backend, decode (and therefore CUDA graphs) on another. Its metadata is the chosen
    half's AttentionStep."""

    def __init__(self, prefill: AttentionBackend, decode: AttentionBackend) -> None:
        self.prefill_backend = prefill
        self.decode_backend = decode
        self.name = f"{prefill.name},{decode.name}"
        self.supports_cuda_graph = decode.supports_cuda_graph
        self.supports_cascade = decode.supports_cascade

    def prepare(self, batch: ForwardBatch) -> AttentionStep:
        return (self.decode_backend if batch.is_decode else self.prefill_backend).step(batch)

    def forward(self, q, k, v, layer_id: int, meta: AttentionStep) -> torch.Tensor:
        return meta(q, k, v, layer_id)

    def kv_store_target(self, layer_id: int, meta: AttentionStep) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
        return meta.kv_store_target(layer_id)

    def init_graph_state(self, max_bs: int, max_seq_len: int) -> None:
        self.decode_backend.init_graph_state(max_bs, max_seq_len)

    def verify_backend(self) -> Optional[AttentionBackend]:
        return self.prefill_backend.verify_backend()  # a verify step is an extend step: the prefill half's

    def init_cascade_state(self) -> None:
        self.decode_backend.init_cascade_state()

    def prepare_for_capture(self, batch: ForwardBatch) -> AttentionStep:
        return AttentionStep(self.decode_backend, self.decode_backend.prepare_for_capture(batch))

    def prepare_for_replay(self, batch: ForwardBatch, padded_bs: int, meta: AttentionStep) -> None:
        self.decode_backend.prepare_for_replay(batch, padded_bs, meta.meta)
