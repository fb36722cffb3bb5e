"""A HF directory's safetensors files as (HF name, StoredTensor) pairs, each file's header checked first.

Every file's header is read and each tensor's bytes are checked against the file's size before any tensor is read,
so a truncated or damaged file is a WeightLoadError naming the file and the damage, not an error from deep inside
the safetensors library (or a short read)."""
from __future__ import annotations

import glob
import json
import os
from typing import Any, Iterator, List, Optional, Tuple

import torch

from .checkpoint import StoredTensor, Unreadable, WeightLoadError, check_tensor_spans, damaged
from .safetensors_stream import read_header
from minisrv.models.sharding import Slice


def safetensors_files(path: str) -> List[str]:
    """The files of the directory's index when it has one (every one of them must be there), else all of them."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        missing = [f for f in files if not os.path.isfile(os.path.join(path, f))]
        if missing:
            raise WeightLoadError(f"{index} lists files that are missing: {missing}")
        return [os.path.join(path, f) for f in files]
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise WeightLoadError(f"no *.safetensors files in {path}")
    return files


def check_safetensors_file(file: str) -> None:
    """Raises WeightLoadError naming the file if its header cannot be read or a tensor lies past its end."""
    try:
        size = os.path.getsize(file)
        with open(file, "rb") as f:
            hlen, header = read_header(f, size, Unreadable)
        spans = []  # (tensor name, first byte, end byte) at absolute file offsets
        for name, info in header.items():
            if name == "__metadata__":
                continue
            offs = info.get("data_offsets") if isinstance(info, dict) else None
            if not (isinstance(offs, list) and len(offs) == 2 and all(type(o) is int and o >= 0 for o in offs)
                    and offs[0] <= offs[1]):
                raise Unreadable(f"tensor {name} has no valid data_offsets: {offs!r}")
            spans.append((name, 8 + hlen + offs[0], 8 + hlen + offs[1]))
    except Unreadable as e:
        raise damaged(file, f"cannot read its safetensors header ({e})") from None
    except OSError as e:
        raise damaged(file, f"cannot read its safetensors header ({type(e).__name__}: {e})") from e
    check_tensor_spans(file, spans, size)


def iter_safetensors(path: str) -> Iterator[Tuple[str, StoredTensor]]:
    """Every tensor of the directory's files, each read (whole or a rank's slice) only when asked."""
    from safetensors import safe_open
    files = safetensors_files(path)
    for file in files:  # every file's header against its size before reading any tensor
        check_safetensors_file(file)
    for file in files:
        try:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():
                    sl = f.get_slice(name)
                    yield name, StoredTensor(tuple(sl.get_shape()), lambda piece, sl=sl: _read_slice(sl, piece))
        except Exception as e:  # safetensors raises its own error types for truncated or corrupt files
            raise WeightLoadError(f"cannot read weight file {file}: {e}") from e


def _read_slice(sl: Any, piece: Optional[Slice]) -> torch.Tensor:
    if piece is None:
        return sl[:] if sl.get_shape() else sl[...]  # a 0-d tensor (a per-tensor scale) takes no slice
    end = piece.start + piece.length
    return sl[piece.start:end] if piece.dim == 0 else sl[:, piece.start:end]
