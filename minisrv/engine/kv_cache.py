"""Paged KV pool, its page allocator, and the request->token table.

A slot is one token's place in the pool: slot = page * page_size + offset. The pool knows pages and slots,
never requests; the request->token table maps (request row, position) to slot and lives on the device so
attention kernels can read it directly.
"""
from __future__ import annotations

from typing import List

import torch

from minisrv.attention.base import to_device


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


class PageAllocator:
    """O(1) alloc and free of pages from a free stack, with reference counts so a prefix can be shared."""

    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self._free: List[int] = list(range(num_pages - 1, -1, -1))  # pop() hands out low pages first
        self._refs = [0] * num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> List[int]:
        if n > len(self._free):
            raise MemoryError(f"KV pool exhausted: asked for {n} pages, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self._refs[p] = 1
        return pages

    def incref(self, pages: List[int]) -> None:
        for p in pages:
            assert self._refs[p] > 0, f"incref of free page {p}"
            self._refs[p] += 1

    def free(self, pages: List[int]) -> None:
        """Drop one reference from each page; pages that reach zero return to the free stack."""
        for p in pages:
            r = self._refs[p]
            assert r > 0, f"double free of page {p}"
            self._refs[p] = r - 1
            if r == 1:
                self._free.append(p)

    def refcount(self, page: int) -> int:
        return self._refs[page]


class ReqToTokenTable:
    """Rows of [max_context] slots, one row per live request, on the device."""

    def __init__(self, max_rows: int, max_context: int, device: torch.device) -> None:
        self.table = torch.zeros((max_rows, max_context), dtype=torch.int32, device=device)
        self._free_rows: List[int] = list(range(max_rows - 1, -1, -1))

    @property
    def num_free_rows(self) -> int:
        return len(self._free_rows)

    def alloc_row(self) -> int:
        if not self._free_rows:
            raise MemoryError("no free request rows")
        return self._free_rows.pop()

    def free_row(self, row: int) -> None:
        self._free_rows.append(row)

    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        self.table[row, start:start + slots.numel()] = to_device(slots, torch.int32, self.table.device)

    def write_points(self, rows: List[int], positions: List[int], slots: List[int]) -> None:
        """table[rows[i], positions[i]] = slots[i], with one host->device copy."""
        idx = to_device([rows, positions, slots], torch.int64, self.table.device)
        self.table[idx[0], idx[1]] = idx[2].to(torch.int32)


def slots_for(pages: List[int], page_size: int, start: int, end: int) -> torch.Tensor:
    """Slots of positions [start, end) of a request owning `pages` (in order)."""
    pos = torch.arange(start, end, dtype=torch.int64)
    page_idx = torch.as_tensor(pages, dtype=torch.int64)[pos // page_size]
    return page_idx * page_size + pos % page_size
