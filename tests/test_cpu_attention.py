"""The CPU attention paths (attention/cpu_paged.py, kernels/cpu_attention.c) against float64 computations.

Decode reads K/V in place in the pool through the request->token table; prompts run packed a sequence at a time.
Both are checked with ragged lengths, pages of 1 and of 16 left partly filled, requests whose rows of the table are
not in batch order, GQA groups of 1, 3 and 4, and extend batches that mix fresh prompts with prompts on a cached
prefix; the backend's decode is also checked against its own padded path (the GPU backends' reference). Sliding
windows shorter than the sequences and soft-capped scores (attention_options.py) are checked on every path.
"""
from __future__ import annotations

import pytest
import torch

from minisrv.attention.cpu_paged import PackedMeta
from minisrv.attention.torch_native import TorchNativeBackend
from minisrv.batch import ForwardBatch, ForwardMode
from minisrv.kernels.cpu_attention import PagedDecodeKernel, paged_decode_reference
from minisrv.kernels.cpu_decode import DecodeMeta
from minisrv.kvcache import KVPool
from minisrv.models.attention_options import LayerAttention

KERNEL, HOW = PagedDecodeKernel.load()
needs_kernel = pytest.mark.skipif(KERNEL is None, reason=f"the CPU attention kernel cannot be built here: {HOW}")


def reference(q, keys, values, q_pos, scale, window=None, softcap=None, sinks=None):
    """Float64 attention of queries [n, Hq, D] at positions q_pos over keys/values [L, Hkv, D] (position = index):
    causal, within the last `window` positions, scores soft-capped, each head's sink logit (a sequence of Hq) a
    column of the softmax whose weight goes nowhere."""
    g = q.shape[1] // keys.shape[1]
    kk = keys.double().repeat_interleave(g, dim=1)
    vv = values.double().repeat_interleave(g, dim=1)
    s = torch.einsum("qhd,khd->hqk", q.double(), kk) * scale
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    k_pos = torch.arange(keys.shape[0])[None, None, :]
    s = s.masked_fill(k_pos > q_pos[None, :, None], float("-inf"))
    if window:
        s = s.masked_fill(k_pos <= q_pos[None, :, None] - window, float("-inf"))
    if sinks is not None:
        sink = torch.tensor(sinks, dtype=torch.float64)[:, None, None].expand(s.shape[0], s.shape[1], 1)
        return torch.einsum("hqk,khd->qhd", torch.cat([s, sink], -1).softmax(-1)[..., :-1], vv)
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), vv)


def scatter_rows(lens, page_size, num_rows, width, seed):
    """A request->token table whose requests' pages are shuffled over the pool (rows 0..num_rows-1), and each
    request's row: batch entry i lives on row rows[i]."""
    gen = torch.Generator().manual_seed(seed)
    pages_per = [-(-n // page_size) for n in lens]
    pages = torch.randperm(sum(pages_per) + 3, generator=gen)
    rows = torch.randperm(num_rows, generator=gen)[:len(lens)]
    table = torch.zeros((num_rows, width), dtype=torch.int32)
    used = 0
    for i, n in enumerate(lens):
        mine = pages[used:used + pages_per[i]]
        used += pages_per[i]
        slots = (mine[:, None] * page_size + torch.arange(page_size)[None, :]).reshape(-1)[:n]
        table[rows[i], :n] = slots.int()
    return table, rows, sum(pages_per) + 3


WINDOW_SOFTCAP = [(0, 0.0), (16, 0.0), (0, 2.0), (5, 3.0)]  # (window, softcap); 0: none


@needs_kernel
@pytest.mark.parametrize("window,softcap", WINDOW_SOFTCAP)
@pytest.mark.parametrize("hq,hkv,d", [(4, 4, 32), (9, 3, 64), (8, 2, 128)])
@pytest.mark.parametrize("page_size", [1, 16])
def test_paged_decode_kernel_matches_float64(hq, hkv, d, page_size, window, softcap):
    lens = [1, 17, 5, 64, 33, 2]  # pages of 16 left partly filled; a request with one key
    table, rows, num_pages = scatter_rows(lens, page_size, 9, 80, seed=hq + page_size)
    torch.manual_seed(0)
    kv = torch.randn(2, num_pages * page_size, hkv, d)
    q = torch.randn(len(lens), hq, d)
    kv_lens = torch.tensor(lens, dtype=torch.int32)
    out = KERNEL(q, kv[0], kv[1], table, rows, kv_lens, d ** -0.5, window, softcap)
    ref = paged_decode_reference(q, kv[0], kv[1], table, rows, kv_lens, d ** -0.5, window, softcap)
    assert (out.double() - ref).abs().max() < 2e-6
    for i, n in enumerate(lens):  # and the reference is attention over each request's keys by position
        slots = table[rows[i], :n].long()
        direct = reference(q[i:i + 1], kv[0][slots], kv[1][slots], torch.tensor([n - 1]), d ** -0.5, window,
                           softcap)
        assert torch.allclose(ref[i], direct[0], atol=1e-12)


@needs_kernel
@pytest.mark.parametrize("window,softcap", WINDOW_SOFTCAP)
@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (8, 8, 32)])
def test_paged_decode_kernel_groups_a_verify_steps_queries(hq, hkv, d, window, softcap):
    """A verify step's queries of one request are consecutive rows with the same request row, each seeing one more
    key than the last (read as one group, each K/V row once); groups of 1-5 beside single decode rows."""
    req_lens = [40, 3, 70, 9]
    per_req = [5, 1, 3, 2]
    table, req_rows, num_pages = scatter_rows(req_lens, 16, 6, 96, seed=hq)
    rows = torch.cat([req_rows[i].repeat(n) for i, n in enumerate(per_req)])
    kv_lens = torch.tensor([n - q + 1 + j for n, q in zip(req_lens, per_req) for j in range(q)], dtype=torch.int32)
    torch.manual_seed(1)
    kv = torch.randn(2, num_pages * 16, hkv, d)
    q = torch.randn(len(rows), hq, d)
    out = KERNEL(q, kv[0], kv[1], table, rows, kv_lens, d ** -0.5, window, softcap)
    ref = paged_decode_reference(q, kv[0], kv[1], table, rows, kv_lens, d ** -0.5, window, softcap)
    assert (out.double() - ref).abs().max() < 2e-6


@needs_kernel
@pytest.mark.parametrize("window", [0, 6])
@pytest.mark.parametrize("hq,hkv,d", [(4, 4, 32), (8, 2, 64)])
def test_paged_decode_kernel_with_sinks_matches_float64(hq, hkv, d, window):
    """gpt-oss's sinks: a logit per query head in each softmax's denominator (large and small against the scores,
    so that they move the output), with and without a window, verify groups beside single rows."""
    req_lens, per_req = [1, 40, 9, 70], [1, 3, 1, 2]
    table, req_rows, num_pages = scatter_rows(req_lens, 16, 6, 96, seed=hq + window)
    rows = torch.cat([req_rows[i].repeat(n) for i, n in enumerate(per_req)])
    kv_lens = torch.tensor([n - q + 1 + j for n, q in zip(req_lens, per_req) for j in range(q)], dtype=torch.int32)
    torch.manual_seed(2)
    kv = torch.randn(2, num_pages * 16, hkv, d)
    q = torch.randn(len(rows), hq, d)
    sinks = torch.linspace(-3.0, 4.0, hq)
    out = KERNEL(q, kv[0], kv[1], table, rows, kv_lens, d ** -0.5, window, 0.0, sinks)
    ref = paged_decode_reference(q, kv[0], kv[1], table, rows, kv_lens, d ** -0.5, window, 0.0, sinks)
    assert (out.double() - ref).abs().max() < 2e-6
    plain = paged_decode_reference(q, kv[0], kv[1], table, rows, kv_lens, d ** -0.5, window)
    assert (plain - ref).abs().max() > 0.05  # the sinks matter here
    for i, (row, n) in enumerate(zip(rows.tolist(), kv_lens.tolist())):  # against attention by position
        slots = table[row, :n].long()
        direct = reference(q[i:i + 1], kv[0][slots], kv[1][slots], torch.tensor([n - 1]), d ** -0.5, window,
                           sinks=sinks.tolist())
        assert torch.allclose(ref[i], direct[0], atol=1e-12)


@needs_kernel
def test_paged_decode_kernel_reads_strided_queries_and_pool_rows():
    """q as a strided view (a fused qkv output's q part) and a pool whose K rows are one half of a [2, ...] tensor."""
    lens = [7, 30]
    table, rows, num_pages = scatter_rows(lens, 1, 2, 32, seed=3)
    qkv = torch.randn(2, 12 * 16)
    q = qkv[:, :8 * 16].view(2, 8, 16)
    kv = torch.randn(2, num_pages, 2, 16)
    out = KERNEL(q, kv[0], kv[1], table, rows, torch.tensor(lens, dtype=torch.int32), 0.3)
    ref = paged_decode_reference(q, kv[0], kv[1], table, rows, torch.tensor(lens, dtype=torch.int32), 0.3)
    assert (out.double() - ref).abs().max() < 2e-6


def _batch(mode, lens, exts, rows, loc, positions):
    t = sum(exts)
    cu = torch.tensor([0] + exts, dtype=torch.int32).cumsum(0).to(torch.int32)
    return ForwardBatch(mode, torch.zeros(t, dtype=torch.int64), positions, loc, rows,
                        torch.tensor(lens, dtype=torch.int32), cu, (cu[1:] - 1).long(), list(lens), list(exts),
                        max(lens))


# each layer's attention: plain; a window shorter than most sequences; soft-capped scores with another scale; sinks
# (of the 6 query heads), with a window and without
SINKS = (-2.0, 0.5, 3.0, 1.0, -0.5, 2.0)
LAYERS = (LayerAttention(32 ** -0.5), LayerAttention(32 ** -0.5, window=6), LayerAttention(0.1, softcap=2.0),
          LayerAttention(32 ** -0.5, window=11, softcap=3.0), LayerAttention(32 ** -0.5, window=6, sinks=SINKS),
          LayerAttention(32 ** -0.5, sinks=SINKS))


@pytest.mark.parametrize("page_size", [1, 16])
def test_backend_extend_packed_then_decode_in_place(page_size):
    """An extend batch mixing fresh prompts with prompts on a cached prefix (and a one-token extend), then a decode
    step over the same requests: each against float64 attention over the request's keys, and the decode against
    the backend's padded path; layers with windows, soft-capping and sinks beside a plain one."""
    hq, hkv, d, layers = 6, 2, 32, len(LAYERS)
    prefix = [0, 13, 0, 40, 7]
    exts = [9, 20, 1, 5, 16]
    lens = [p + e for p, e in zip(prefix, exts)]
    table, rows, num_pages = scatter_rows([n + 1 for n in lens], page_size, 7, 96, seed=page_size)
    pool = KVPool(layers, num_pages, page_size, hkv, d, torch.float32, torch.device("cpu"))
    backend = TorchNativeBackend(pool, table, hq, LAYERS)
    torch.manual_seed(1)
    keys = {(layer, i): torch.randn(n + 1, hkv, d) for layer in range(layers) for i, n in enumerate(lens)}
    values = {(layer, i): torch.randn(n + 1, hkv, d) for layer in range(layers) for i, n in enumerate(lens)}
    for layer in range(layers):  # the cached prefixes, as an earlier step stored them
        for i, p in enumerate(prefix):
            if p:
                pool.store(layer, table[rows[i], :p].long(), keys[layer, i][:p], values[layer, i][:p])
    loc = torch.cat([table[rows[i], p:n].long() for i, (p, n) in enumerate(zip(prefix, lens))])
    positions = torch.cat([torch.arange(p, n) for p, n in zip(prefix, lens)])
    ext = _batch(ForwardMode.EXTEND, lens, exts, rows, loc, positions)
    step = backend.step(ext)
    assert isinstance(step.meta, PackedMeta)
    for layer in range(layers):
        q = torch.randn(sum(exts), hq, d)
        k = torch.cat([keys[layer, i][p:n] for i, (p, n) in enumerate(zip(prefix, lens))])
        v = torch.cat([values[layer, i][p:n] for i, (p, n) in enumerate(zip(prefix, lens))])
        out = step(q, k, v, layer)
        start = 0
        for i, (p, n) in enumerate(zip(prefix, lens)):
            ref = reference(q[start:start + n - p], keys[layer, i][:n], values[layer, i][:n], torch.arange(p, n),
                            *_options(layer))
            assert (out[start:start + n - p].double() - ref).abs().max() < 2e-6, (layer, i)
            padded = backend.forward(q, k, v, layer, backend.prepare_padded(ext))[start:start + n - p]
            assert (padded.double() - ref).abs().max() < 2e-6, (layer, i)
            start += n - p
    # one decode step: every request's next token, its keys read where the steps above stored them
    dec_lens = [n + 1 for n in lens]
    loc = torch.stack([table[rows[i], n].long() for i, n in enumerate(lens)])
    dec = _batch(ForwardMode.DECODE, dec_lens, [1] * len(lens), rows, loc, torch.tensor(lens))
    step = backend.step(dec)
    if KERNEL is not None:
        assert isinstance(step.meta, DecodeMeta)
    for layer in range(layers):
        q = torch.randn(len(lens), hq, d)
        k = torch.stack([keys[layer, i][n] for i, n in enumerate(lens)])
        v = torch.stack([values[layer, i][n] for i, n in enumerate(lens)])
        out = step(q, k, v, layer)
        padded = backend.forward(q, k, v, layer, backend.prepare_padded(dec))
        for i, n in enumerate(dec_lens):
            ref = reference(q[i:i + 1], keys[layer, i][:n], values[layer, i][:n], torch.tensor([n - 1]),
                            *_options(layer))
            assert (out[i].double() - ref[0]).abs().max() < 2e-6, (layer, i)
        assert (out - padded).abs().max() < 2e-6


def _options(layer):
    a = LAYERS[layer]
    return a.scale, a.window, a.softcap, a.sinks


def test_fp8_pool_keeps_the_padded_path():
    pool = KVPool(1, 8, 1, 2, 8, torch.float32, torch.device("cpu"), torch.float8_e4m3fn)
    backend = TorchNativeBackend(pool, torch.arange(8, dtype=torch.int32)[None], 4)
    assert backend.cpu is None
