"""The request->token table: (request row, position) -> pool slot, on the device so attention kernels read it
directly."""
from __future__ import annotations

from typing import List

import torch

from minisrv.utils import host_tensor, to_device


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
    page_idx = host_tensor(pages, torch.int64)[pos // page_size]
    return page_idx * page_size + pos % page_size
