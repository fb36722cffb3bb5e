"""Small helpers shared across floors: page arithmetic and host->device copies that never synchronise."""
from __future__ import annotations

import torch


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def to_device(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list or CPU tensor on `device`, copied from pinned memory without waiting for the device.

    A plain `torch.tensor(..., device="cuda")` or blocking `.to("cuda")` synchronises the stream: the host would
    wait for every queued kernel, and overlap scheduling would be lost. The pinned block is recycled by torch's
    caching host allocator only once the copy has run.
    """
    if device.type != "cuda":
        return torch.as_tensor(values, dtype=dtype).to(device)
    if isinstance(values, torch.Tensor):
        host = torch.empty(values.shape, dtype=dtype, pin_memory=True).copy_(values)
    else:
        host = torch.tensor(values, dtype=dtype, pin_memory=True)
    return host.to(device, non_blocking=True)
