"""What every checkpoint format hands the loader: tensors not yet read (`StoredTensor`: a tensor-parallel rank reads
only its slice), and `WeightLoadError`, with the check that names a damaged file's first cut tensor from its header
alone (a memory-mapped read past the end fails confusingly, or returns a short array)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, List, Optional, Tuple

if TYPE_CHECKING:  # annotations only: the HTTP process reads model files through this package without torch
    import torch

    from minisrv.models.sharding import Slice


class WeightLoadError(ValueError):
    pass


class Unreadable(Exception):
    """Why a checkpoint file's header cannot be parsed (becomes the reason in a WeightLoadError)."""


def damaged(file: str, what: str) -> WeightLoadError:
    return WeightLoadError(f"{file} is truncated or damaged: {what}")


def check_tensor_spans(file: str, spans: List[Tuple[str, int, int]], size: int) -> None:
    """spans: (tensor name, first byte, end byte) at absolute file offsets. The first tensor (in file order) whose
    bytes run past the end of the file is named, so a cut file reads as where it was cut."""
    for name, begin, end in sorted(spans, key=lambda s: (s[1], s[2])):
        if end > size:
            raise damaged(file, f"tensor {name} needs bytes {begin}..{end}, the file has {size}")


class StoredTensor:
    """A checkpoint tensor before it is read: its shape, and a reader of all of it or of one rank's slice."""

    def __init__(self, shape: Tuple[int, ...], read: Callable[[Optional[Slice]], torch.Tensor]) -> None:
        self.shape = shape
        self.read = read

    @classmethod
    def in_memory(cls, w: torch.Tensor) -> "StoredTensor":
        return cls(tuple(w.shape), lambda piece: w if piece is None else w.narrow(piece.dim, piece.start, piece.length))
