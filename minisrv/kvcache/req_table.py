"""The request->token table: (request row, position) -> pool slot, on the device so attention kernels read it
directly."""
from __future__ import annotations

from typing import Any, List, Optional, Tuple

import torch

from minisrv.utils import ceil_div, host_tensor, to_device


class ReqToTokenTable:
    """Rows of [max_context] slots, one row per live request. With `journal` a list (tensor parallelism's rank 0),
    every write is also noted there, for the other ranks to replay on their copies before the same step.
    `windowed`: a second table of the same rows, `window_table`, maps positions to the slots of the windowed layers'
    own pages (pool.py); a write with `window` True goes there. Its entries before a request's window are stale."""

    def __init__(self, max_rows: int, max_context: int, device: torch.device, windowed: bool = False) -> None:
        self.table = torch.zeros((max_rows, max_context), dtype=torch.int32, device=device)
        self.window_table = torch.zeros_like(self.table) if windowed else None
        self._free_rows: List[int] = list(range(max_rows - 1, -1, -1))
        self.journal: Optional[List[Tuple[Any, ...]]] = None

    @property
    def num_free_rows(self) -> int:
        return len(self._free_rows)

    def alloc_row(self) -> int:
        if not self._free_rows:
            raise MemoryError("no free request rows")
        return self._free_rows.pop()

    def free_row(self, row: int) -> None:
        self._free_rows.append(row)

    def write(self, row: int, start: int, slots: torch.Tensor, window: bool = False) -> None:
        if self.journal is not None:
            self.journal.append(("span", row, start, slots, window))
        table = self.window_table if window else self.table
        table[row, start:start + slots.numel()] = to_device(slots, torch.int32, table.device)

    def write_points(self, rows: List[int], positions: List[int], slots: List[int], window: bool = False) -> None:
        """table[rows[i], positions[i]] = slots[i], with one host->device copy."""
        if self.journal is not None:
            self.journal.append(("points", rows, positions, slots, window))
        table = self.window_table if window else self.table
        idx = to_device([rows, positions, slots], torch.int64, table.device)
        table[idx[0], idx[1]] = idx[2].to(torch.int32)

    def take_journal(self) -> List[Tuple[Any, ...]]:
        writes, self.journal = self.journal, []
        return writes

    def replay(self, writes: List[Tuple[Any, ...]]) -> None:
        for kind, *args in writes:
            (self.write if kind == "span" else self.write_points)(*args)


def slots_for(pages: List[int], page_size: int, start: int, end: int) -> torch.Tensor:
    """Slots of positions [start, end) of a request owning `pages` (in order), built a page at a time from only the
    pages the range touches (not a division and a gather per position)."""
    first, last = start // page_size, ceil_div(end, page_size)
    if last > len(pages):
        raise IndexError(f"positions up to {end} need {last} pages, the request has {len(pages)}")
    page_t = host_tensor(pages[first:last], torch.int64)
    slots = (page_t[:, None] * page_size + torch.arange(page_size, dtype=torch.int64)).view(-1)
    return slots[start - first * page_size:end - first * page_size]
