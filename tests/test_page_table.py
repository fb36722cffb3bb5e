"""The page-table form of a batch (attention/page_table.py), which FA3, XQA and the triton decode read: each
request's page ids in order, against the pages the requests were given; the CUDA-graph copy, rewritten for a smaller
batch with padding rows, against the same computed directly; and the graph hooks built on it."""
from __future__ import annotations

import dataclasses
import importlib.util
import random

import pytest
import torch

from minisrv.batch import ForwardBatch, ForwardMode
from minisrv.attention.page_table import StaticPageTable, page_table, require

MAX_CONTEXT = 96


def scene(page_size: int, lens, seed: int = 0):
    """A request->token table whose rows hold shuffled pages, and a decode batch of rows 0..B-1 with `lens`."""
    rng = random.Random(seed)
    num_pages = sum(-(-n // page_size) for n in lens) + 3
    free = list(range(num_pages))
    rng.shuffle(free)
    table = torch.zeros((len(lens) + 1, MAX_CONTEXT), dtype=torch.int32)
    pages = []
    for row, n in enumerate(lens):
        mine = [free.pop() for _ in range(-(-n // page_size))]
        pages.append(mine)
        slots = [p * page_size + k for p in mine for k in range(page_size)][:n]
        table[row, :n] = torch.tensor(slots, dtype=torch.int32)
    b = len(lens)
    batch = ForwardBatch(ForwardMode.DECODE, torch.zeros(b, dtype=torch.int64), torch.tensor(lens) - 1,
                         torch.zeros(b, dtype=torch.int64), torch.arange(b), torch.tensor(lens, dtype=torch.int32),
                         torch.arange(b + 1, dtype=torch.int32), torch.arange(b), list(lens), [1] * b, max(lens))
    return table, batch, pages


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_page_table_lists_each_requests_pages(page_size):
    lens = [5, 33, 17, 64, 1]
    table, batch, pages = scene(page_size, lens)
    got = page_table(table, batch.req_rows, batch.max_seq_len, page_size)
    assert got.dtype == torch.int32 and got.shape == (len(lens), -(-max(lens) // page_size))
    for row, mine in enumerate(pages):
        assert got[row, :len(mine)].tolist() == mine


@pytest.mark.parametrize("page_size", [1, 16])
def test_static_table_rewritten_for_each_replay(page_size):
    """A graph of 8 rows replayed for a batch of 5: its leading rows equal the direct page table (the columns past
    them are never read: the lengths bound them), padding rows point one token at page 0."""
    static = StaticPageTable(8, MAX_CONTEXT, page_size, torch.device("cpu"))
    big, big_batch, _ = scene(page_size, [90, 3, 40, 17, 60, 2, 8, 33], seed=1)
    static.fill(big, big_batch, 8)  # an earlier, larger batch leaves its values behind
    lens = [5, 33, 17, 64, 1]
    table, batch, _ = scene(page_size, lens, seed=2)
    static.fill(table, batch, 8)
    rows, seq_lens = static.rows(8)
    direct = page_table(table, batch.req_rows, batch.max_seq_len, page_size)
    assert torch.equal(rows[:5, :direct.shape[1]], direct)
    assert seq_lens.tolist() == lens + [1, 1, 1]
    assert rows[5:, 0].tolist() == [0, 0, 0]
    assert rows.shape == (8, -(-MAX_CONTEXT // page_size))


def test_static_table_refuses_what_it_cannot_hold():
    static = StaticPageTable(4, 32, 16, torch.device("cpu"))
    table, batch, _ = scene(16, [40, 3])
    with pytest.raises(ValueError, match="exceeds the graph's max_seq_len"):
        static.fill(table, batch, 2)
    table, batch, _ = scene(16, [10, 3])
    with pytest.raises(ValueError, match="padded batch size 1 outside"):
        static.fill(table, batch, 1)
    with pytest.raises(ValueError, match="padded batch size 5 outside"):
        static.fill(table, batch, 5)
    with pytest.raises(RuntimeError, match="init_graph_state"):
        require(None)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_triton_decode_backend_metadata_and_graph_hooks():
    """The triton decode half built over a CPU pool (its kernel is only compiled when run): a decode step's metadata
    is the direct page table and lengths; a captured graph's is the static table's rows, which a replay of a smaller
    batch rewrites (PageTableGraphs, shared with fa and xqa); extend steps are refused."""
    from minisrv.attention.triton_decode import TritonDecodeBackend
    from minisrv.kvcache import KVPool

    ps = 4
    lens = [5, 33, 17, 64]
    table, batch, _ = scene(ps, lens, seed=3)
    pool = KVPool(2, 64, ps, 2, 16, torch.float32, torch.device("cpu"))
    backend = TritonDecodeBackend(pool, table, 4)
    meta = backend.prepare(batch)
    assert torch.equal(meta.page_table, page_table(table, batch.req_rows, batch.max_seq_len, ps))
    assert meta.seq_lens.tolist() == lens and meta.loc is batch.out_cache_loc
    backend.init_graph_state(4, MAX_CONTEXT)
    captured = backend.prepare_for_capture(batch)
    assert captured.page_table.shape == (4, MAX_CONTEXT // ps) and captured.seq_lens.tolist() == lens
    _, small_batch, _ = scene(ps, [9, 2, 30], seed=4)  # rows 0-2 of the backend's table, shorter
    backend.prepare_for_replay(small_batch, 4, captured)
    direct = page_table(table, small_batch.req_rows, small_batch.max_seq_len, ps)
    assert torch.equal(captured.page_table[:3, :direct.shape[1]], direct)
    assert captured.seq_lens.tolist() == [9, 2, 30, 1] and captured.page_table[3, 0].item() == 0
    extend = dataclasses.replace(batch, mode=ForwardMode.EXTEND)
    with pytest.raises(ValueError, match="decode steps only"):
        backend.prepare(extend)
    with pytest.raises(ValueError, match="decode batches only"):
        backend.prepare_for_capture(extend)
