"""The shared-memory step channel (minisrv/step_channel.py): what a reader process gets is what the writer sent,
tensors included, in order; an oversize message says so; a writer waiting for a lost reader fails instead of
hanging."""
from __future__ import annotations

import multiprocessing as mp
import pickle

import pytest
import torch

from minisrv.engine.model_runner import StepInputs
from minisrv.attention.base import ForwardMode
from minisrv.step_channel import ShmBroadcast, dumps


def _messages():
    ints = torch.arange(-5, 300, dtype=torch.int64)
    yield StepInputs(ForwardMode.DECODE, ints, 2, [3, 4], [1, 1], None, table_writes=[
        ("span", 1, 0, torch.arange(16, dtype=torch.int64)), ("points", [1, 2], [3, 4], [5, 6])])
    yield {"bf16": torch.randn(3, 5, dtype=torch.float32, generator=torch.Generator().manual_seed(0)).bfloat16(),
           "i32": torch.tensor([[1, -2], [3, 2**31 - 1]], dtype=torch.int32), "empty": torch.empty(0, 4),
           "strided": torch.arange(12).view(3, 4).t(), "scalar": torch.tensor(2.5)}
    yield "stop-now"


def _reader(name: str, n: int, q) -> None:
    ch = ShmBroadcast.attach(name, 1, 0)
    for _ in range(n):
        payload = ch.read()
        q.put(("oversize", None) if payload is None else ("ok", payload))
    ch.close()


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, StepInputs):
        return all(_same(getattr(a, f), getattr(b, f)) for f in a.__dataclass_fields__)
    return a == b


def test_a_reader_process_gets_every_message_in_order():
    msgs = list(_messages())
    ch = ShmBroadcast.create(1, capacity=1 << 16)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_reader, args=(ch.name, len(msgs) + 1, q))
    p.start()
    try:
        for m in msgs:
            assert ch.write(dumps(m))
        assert not ch.write(b"x" * (ch.capacity + 1))  # too big: announced, for the caller's fallback
        got = [q.get(timeout=60) for _ in range(len(msgs) + 1)]
    finally:
        p.join(60)
        ch.unlink()
        ch.close()
    assert [kind for kind, _ in got] == ["ok"] * len(msgs) + ["oversize"]
    for m, (_, payload) in zip(msgs, got):
        assert _same(m, pickle.loads(payload))


def test_tensors_travel_as_raw_bytes():
    """torch's own pickling of a tensor goes through torch.save; the channel's is the bytes plus a header."""
    t = torch.arange(1000, dtype=torch.int64)
    assert len(dumps(t)) < t.numel() * 8 + 200 < len(pickle.dumps(t))
    assert torch.equal(pickle.loads(dumps(t)), t)


def test_a_writer_waiting_for_a_lost_reader_raises():
    ch = ShmBroadcast.create(1, capacity=1024)
    try:
        assert ch.write(b"first")  # nobody reads it: the next write waits for the acknowledgement

        class Lost(RuntimeError):
            pass

        def check():
            raise Lost("rank 1 is gone")

        with pytest.raises(Lost):
            ch.write(b"second", check)
    finally:
        ch.unlink()
        ch.close()


def test_a_reader_in_this_process_sees_what_was_written_and_acknowledges_it():
    w = ShmBroadcast.create(2, capacity=1024)
    r0, r1 = (ShmBroadcast.attach(w.name, 2, i) for i in range(2))
    try:
        for k in range(3):
            assert w.write(f"step {k}".encode())
            assert r0.read() == r1.read() == f"step {k}".encode()
    finally:
        for c in (r0, r1):
            c.close()
        w.unlink()
        w.close()
