"""A safetensors file written one tensor at a time, so that a model's tensors never have to be in memory together
(safetensors' save_file takes them all at once), and read back as tensors over a memory map of the file (no copy).

The header, which holds every tensor's offsets, comes before the data: the writer leaves room for it (from the
number of tensors expected; the data starts on a 4 KiB boundary), streams the data, then writes the header into the
room, padded with spaces. Tensors follow one another without gaps; a caller that wants each aligned to its element
size writes the wider dtypes first."""
from __future__ import annotations

import json
import math
import mmap
import os
import struct
from typing import Any, BinaryIO, Dict, List, Optional, Tuple

import torch

DATA_ALIGN = 4096
MAX_HEADER = 100_000_000  # the safetensors library refuses larger headers too
DTYPE_NAMES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
               torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
               torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}
ROOM_PER_TENSOR = 384  # bytes of header per tensor: a name of up to ~250 characters, a 4-D shape, two offsets


class HeaderTooLarge(ValueError):
    pass


class SafetensorsStream:
    """out = SafetensorsStream(path, expected_tensors); out.add(name, tensor) ...; out.close(complete=True) writes
    the header. A write that fails (a full disk) is kept in `error` and the later adds are skipped: the caller
    decides what an incomplete file means."""

    def __init__(self, path: str, expected_tensors: int) -> None:
        self.path = path
        self.room = -(-(8 + expected_tensors * ROOM_PER_TENSOR + 1024) // DATA_ALIGN) * DATA_ALIGN - 8
        self.entries: List[tuple] = []
        self.offset = 0
        self.error: Optional[Exception] = None
        self.file: BinaryIO = open(path, "wb")
        self.file.seek(8 + self.room)

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if self.error is not None:
            return
        t = tensor.detach().contiguous().cpu()
        if t.dtype not in DTYPE_NAMES:
            raise ValueError(f"safetensors has no dtype for {t.dtype}")
        try:
            if t.numel():
                self.file.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
        except OSError as e:
            self.error = e
            return
        size = t.numel() * t.element_size()
        self.entries.append((name, DTYPE_NAMES[t.dtype], list(t.shape), self.offset, self.offset + size))
        self.offset += size

    def close(self, complete: bool) -> bool:
        """Close the file, with its header if `complete` and nothing failed; True if the file is whole."""
        try:
            if complete and self.error is None:
                self._write_header()
        except (OSError, HeaderTooLarge) as e:
            self.error = e
        finally:
            self.file.close()
        return complete and self.error is None

    def _write_header(self) -> None:
        header = {name: {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}
                  for name, dtype, shape, begin, end in self.entries}
        raw = json.dumps(header, separators=(",", ":")).encode()
        if len(raw) > self.room:
            raise HeaderTooLarge(f"the header needs {len(raw)} bytes, {self.room} were left for it")
        self.file.seek(0)
        self.file.write(struct.pack("<Q", self.room) + raw + b" " * (self.room - len(raw)))


DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}


class BadFile(ValueError):
    """Why a file cannot be mapped as safetensors."""


def read_header(f: BinaryIO, size: int, error: type) -> Tuple[int, Dict[str, Any]]:
    """(header length, header) of the safetensors file `f` of `size` bytes, read from its start; raises `error`
    saying what is wrong with it."""
    head = f.read(8)
    if len(head) < 8:
        raise error(f"the file has {size} bytes, fewer than the 8 of the header length")
    (hlen,) = struct.unpack("<Q", head)
    if 8 + hlen > size:
        raise error(f"header length {hlen} runs past the end of the file at byte {size}")
    if hlen > MAX_HEADER:
        raise error(f"header length {hlen} is larger than {MAX_HEADER}")
    raw = f.read(hlen)
    if len(raw) < hlen:
        raise error(f"header length {hlen} runs past the end of the file at byte {8 + len(raw)}")
    try:
        header = json.loads(raw)
    except ValueError as e:  # json.JSONDecodeError and UnicodeDecodeError
        raise error(f"bad JSON: {e}") from None
    if not isinstance(header, dict):
        raise error(f"the header is a JSON {type(header).__name__}, not an object")
    return hlen, header


def map_tensors(path: str) -> Dict[str, torch.Tensor]:
    """name -> tensor, each a view of one private (copy-on-write) memory map of the file. Every header entry is
    checked against the file's size first: a truncated or damaged file is a BadFile, not a crash."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        hlen, header = read_header(f, size, BadFile)
        header.pop("__metadata__", None)
        entries = {}
        for name, info in header.items():
            try:
                dtype, shape, (begin, end) = DTYPES[info["dtype"]], [int(d) for d in info["shape"]], \
                    info["data_offsets"]
            except (KeyError, TypeError, ValueError):
                raise BadFile(f"tensor {name}: bad entry {info!r}") from None
            nbytes = math.prod(shape) * dtype.itemsize
            if not (0 <= begin and end - begin == nbytes and 8 + hlen + end <= size):
                raise BadFile(f"tensor {name}: bytes {begin}..{end} do not hold {shape} {dtype} within the file's "
                              f"{size} bytes")
            if (8 + hlen + begin) % dtype.itemsize:
                raise BadFile(f"tensor {name} is not aligned to its element size")
            entries[name] = (dtype, shape, 8 + hlen + begin, nbytes)
        if not entries:
            return {}
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    data = torch.frombuffer(mapped, dtype=torch.uint8)
    return {name: data[at:at + n].view(dtype).view(shape) if n else torch.empty(shape, dtype=dtype)
            for name, (dtype, shape, at, n) in entries.items()}
