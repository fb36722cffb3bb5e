"""Small helpers shared across floors: page arithmetic, host tensors from Python lists, host->device copies
that never synchronise, and the start-up heap kept out of the garbage collector's walk."""
from __future__ import annotations

import gc
import importlib
from array import array
from typing import Any, Optional

import torch

# array typecodes whose items have the tensor dtype's layout ('i' is a C int: 4 bytes on every platform torch runs on)
_ARRAY_CODES = {torch.int64: "q", torch.float32: "f", torch.float64: "d"}
if array("i").itemsize == 4:
    _ARRAY_CODES[torch.int32] = "i"


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def host_tensor(values, dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of a list of Python numbers, or of a list of equal-length lists (its rows).

    Built through a typed `array` buffer, converted in one C loop, where `torch.tensor(list)` inspects every element
    (a step's token, position and slot lists pay it every step). Anything the array refuses (a float where an int is
    wanted, a value out of range, ragged rows, another dtype) goes to `torch.tensor`, so the result, or the error, is
    always that of `torch.tensor(values, dtype=dtype)`."""
    code = _ARRAY_CODES.get(dtype)
    if code is None or not isinstance(values, list) or not values:
        return torch.tensor(values, dtype=dtype)
    rows = None
    if isinstance(values[0], list):
        rows, width = len(values), len(values[0])
        if not width or any(not isinstance(v, list) or len(v) != width for v in values):
            return torch.tensor(values, dtype=dtype)
    try:
        buf = array(code)
        for row in values if rows is not None else [values]:
            buf.fromlist(row)
    except (TypeError, OverflowError):
        return torch.tensor(values, dtype=dtype)
    t = torch.frombuffer(buf, dtype=dtype)  # shares buf's memory and keeps it alive
    return t if rows is None else t.view(rows, width)


def to_device(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list or CPU tensor on `device`, copied from pinned memory without waiting for the device.

    A plain `torch.tensor(..., device="cuda")` or blocking `.to("cuda")` synchronises the stream: the host would
    wait for every queued kernel, and overlap scheduling would be lost. The pinned block is recycled by torch's
    caching host allocator only once the copy has run.
    """
    if not isinstance(values, torch.Tensor):
        values = host_tensor(values, dtype)
    if device.type != "cuda":
        return values.to(device=device, dtype=dtype)
    if values.dtype == dtype and values.is_pinned():  # already staged by its maker (e.g. a grammar step's masks)
        return values.to(device, non_blocking=True)
    host = torch.empty(values.shape, dtype=dtype, pin_memory=True).copy_(values)
    return host.to(device, non_blocking=True)


def cuda_import(device: torch.device, module: str, name: Optional[str] = None) -> Optional[Any]:
    """`module.name` (or the module) for work on `device` when it is a CUDA device and the import succeeds, else
    None: the optional GPU kernels (FlashInfer's, Triton's) whose absence means the torch path."""
    if device.type != "cuda":
        return None
    try:
        found = importlib.import_module(module)
        return found if name is None else getattr(found, name)
    except Exception:  # noqa: BLE001 - any import failure means "not present"
        return None


def freeze_startup_heap() -> None:
    """For a process that serves one engine from here on (the server's engine process, a tensor-parallel rank, the
    generate script): collect once, then move every object alive (imports, the model, the tokenizer: 10^5-10^6 of
    them) out of the cyclic garbage collector's walk. A full collection walks every tracked object and stalls the
    host, which a decode loop pays as a late step; after this it walks only what serving created. Frozen objects are
    still freed by reference counting, but cycles among them never are: not for a process that builds engine after
    engine (tests), and `gc.unfreeze()` before dropping one whose teardown needs its cycles collected
    (model_runner.release_graphs)."""
    gc.collect()
    gc.freeze()
