"""The paged KV pool: a slot is one token's place, slot = page * page_size + offset. It knows pages and slots,
never requests."""
from __future__ import annotations

import torch

class KVPool:
    """Per layer, K and V of shape [num_pages, page_size, num_kv_heads, head_dim]: the two halves of one
    [2, num_pages, page_size, num_kv_heads, head_dim] tensor, so a step's new K and V can be stored with one
    kernel when they sit side by side in memory (as they do in a fused qkv projection's output)."""

    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.num_layers = num_layers
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = device
        shape = (2, num_pages, page_size, num_kv_heads, head_dim)
        self.kv = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.k = [kv[0] for kv in self.kv]
        self.v = [kv[1] for kv in self.kv]

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.tensor([], dtype=dtype).element_size()

    @property
    def nbytes(self) -> int:
        return self.num_slots * self.bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim, self.dtype)

    def store(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write k/v [T, Hkv, D] of one layer at slots loc [T]."""
        h, d = self.num_kv_heads, self.head_dim
        kv = self.kv[layer_id].view(2, -1, h, d)
        row = h * d
        if (k.shape == v.shape == (k.shape[0], h, d) and k.stride() == v.stride() and k.stride()[1:] == (d, 1)
                and v.data_ptr() - k.data_ptr() == row * k.element_size()):
            # v follows k in every token's row (a fused qkv output): view both as [2, T, H, D], one scatter
            kv[:, loc] = k.as_strided((2, k.shape[0], h, d), (row, k.stride(0), d, 1))
            return
        kv[0][loc] = k
        kv[1][loc] = v

    def flat_k(self, layer_id: int) -> torch.Tensor:
        return self.k[layer_id].view(-1, self.num_kv_heads, self.head_dim)

    def flat_v(self, layer_id: int) -> torch.Tensor:
        return self.v[layer_id].view(-1, self.num_kv_heads, self.head_dim)
