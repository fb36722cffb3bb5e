"""Rank 0's step messages to the other tensor-parallel ranks, through one shared-memory block on the host.

Why not a gloo broadcast: rank 0 sends a message every step, and under tensor parallelism its host work bounds the
step (on 2 H200s, Llama-3-8B shape, the host waited for the device 1.9 s of a 9.8 s run against 8.6 of 14.0 with
one GPU). `broadcast_object_list` pickles CPU tensors through `torch.save` and makes two TCP round trips over gloo,
a few hundred microseconds a step on each side. Here a message is pickled with its tensors as raw bytes, copied
into the block, and published by a sequence number the readers poll: a few microseconds for a decode step.

Protocol (one writer, `num_readers` readers, one message in flight): the writer waits until every reader has
acknowledged the previous message, writes the payload, then its length, then the new sequence number; a reader
polling the sequence number copies the payload out and acknowledges it before unpickling, so the writer can
publish the next step while the readers run this one. A fence (a lock's acquire and release) orders the writes on
any CPU. A message larger than the block is announced as such and travels through the caller's fallback (gloo).
"""
from __future__ import annotations

import io
import os
import pickle
import threading
import time
from multiprocessing import shared_memory
from typing import Any, Callable, Optional, Tuple

import numpy as np
import torch

HEADER_BYTES = 64  # sequence number, payload length (u64 each), then padding to a cache line
ACK_STRIDE = 64  # each reader's acknowledgement on a cache line of its own
OVERSIZE = np.uint64(2**64 - 1)  # the length field of a message sent through the fallback
DEFAULT_CAPACITY = 4 << 20  # bytes; a decode step of 256 requests is ~10 KiB, a long prefill's table writes more
SPIN_S = 1.0  # a waiting reader yields the CPU between polls this long, then sleeps between them
IDLE_POLL_S = 0.0005


def _fence() -> None:
    """A full memory barrier: taking and releasing a lock orders the stores before it against those after it."""
    _FENCE_LOCK.acquire()
    _FENCE_LOCK.release()


_FENCE_LOCK = threading.Lock()


def _tensor_from_bytes(data: bytes, dtype: str, shape: Tuple[int, ...]) -> torch.Tensor:
    t = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    return t.view(getattr(torch, dtype)).reshape(shape)


class _StepPickler(pickle.Pickler):
    """Pickles CPU tensors as their raw bytes (torch's own reduction goes through `torch.save`, ~100x slower)."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
            raw = obj.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if obj.numel() else b""
            return _tensor_from_bytes, (raw, str(obj.dtype).replace("torch.", ""), tuple(obj.shape))
        return NotImplemented


def dumps(obj: Any) -> bytes:
    buf = io.BytesIO()
    _StepPickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buf.getvalue()


class ShmBroadcast:
    """The block and its protocol. `create()` on rank 0 (the writer); `attach(name, reader)` on ranks 1..N-1."""

    def __init__(self, shm: shared_memory.SharedMemory, num_readers: int, reader: Optional[int]) -> None:
        self.shm = shm
        self.num_readers = num_readers
        self.reader = reader  # this process's reader index (None: the writer)
        self.data_offset = HEADER_BYTES + ACK_STRIDE * num_readers
        self.capacity = shm.size - self.data_offset
        self._header = np.ndarray((2,), dtype=np.uint64, buffer=shm.buf, offset=0)
        self._acks = [np.ndarray((1,), dtype=np.uint64, buffer=shm.buf, offset=HEADER_BYTES + ACK_STRIDE * i)
                      for i in range(num_readers)]
        self._seq = 0  # the newest sequence number this process wrote or read (a reader reads from the first)

    @classmethod
    def create(cls, num_readers: int, capacity: int = DEFAULT_CAPACITY) -> "ShmBroadcast":
        shm = shared_memory.SharedMemory(create=True, size=HEADER_BYTES + ACK_STRIDE * num_readers + capacity)
        shm.buf[:HEADER_BYTES + ACK_STRIDE * num_readers] = bytes(HEADER_BYTES + ACK_STRIDE * num_readers)
        return cls(shm, num_readers, None)

    @classmethod
    def attach(cls, name: str, num_readers: int, reader: int) -> "ShmBroadcast":
        # (the readers are rank 0's spawned children and share its resource tracker, where attaching registers the
        # block a second time in a set: the writer's unlink leaves nothing registered)
        shm = shared_memory.SharedMemory(name=name)
        return cls(shm, num_readers, reader)

    @property
    def name(self) -> str:
        return self.shm.name

    def unlink(self) -> None:
        """Remove the block's name (the writer, once every reader has attached): the mapping lives on until each
        process closes it, and nothing is left behind however the processes end."""
        self.shm.unlink()

    def close(self) -> None:
        self._header = None
        self._acks = []
        try:
            self.shm.close()
        except BufferError:  # a view still exported somewhere; the mapping goes with the process
            pass

    def write(self, payload: bytes, check: Optional[Callable[[], None]] = None) -> bool:
        """Publish payload; False (and an oversize notice published instead) if it does not fit: send it through
        the fallback next. `check` runs while waiting for a slow reader and raises if the group is broken."""
        seq = self._seq
        t0 = time.monotonic()
        next_check = t0 + 0.05
        while any(int(a[0]) != seq for a in self._acks):  # every reader has taken the previous message
            now = time.monotonic()
            if check is not None and now >= next_check:
                check()
                next_check = now + 0.05
            if now - t0 > SPIN_S:
                time.sleep(IDLE_POLL_S)
            else:
                os.sched_yield()
        fits = len(payload) <= self.capacity
        if fits:
            self.shm.buf[self.data_offset:self.data_offset + len(payload)] = payload
        _fence()
        self._header[1] = np.uint64(len(payload)) if fits else OVERSIZE
        _fence()
        self._seq = seq + 1
        self._header[0] = np.uint64(self._seq)
        return fits

    def read(self) -> Optional[bytes]:
        """The next message's payload (waiting for it), or None: it is oversize, read it from the fallback."""
        want = self._seq + 1
        t0 = time.monotonic()
        while int(self._header[0]) != want:
            if time.monotonic() - t0 > SPIN_S:
                time.sleep(IDLE_POLL_S)
            else:
                os.sched_yield()
        _fence()
        n = self._header[1]
        payload = None if n == OVERSIZE else bytes(self.shm.buf[self.data_offset:self.data_offset + int(n)])
        _fence()
        self._seq = want
        self._acks[self.reader][0] = np.uint64(want)
        return payload
