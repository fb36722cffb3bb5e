"""minisrv's Triton decode-attention kernel (kernels/decode_attention.py) on the GPU against its torch reference:
batch sizes 1 to 256 (so the split rule runs from 64 pieces to none), lengths from 1 token to 5,000 mixed in one
batch, GQA groups 1 to 8, pages of 1 and 16 shuffled over the pool, bf16 and FP8 pools, eager and replayed from a
CUDA graph with other lengths than those captured. The backend's own cases (against the torch backend, in
hybrids) are in test_backends.py, test_fp8_kv.py and test_cuda_graph.py."""
from __future__ import annotations

import pytest
import torch

from minisrv.kernels.decode_attention import reference, splits_for, triton_decode_attention

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

FP8 = torch.float8_e4m3fn


def scene(bs, hq, hkv, d, ps, lens, kv_dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    dev = torch.device("cuda")
    pages = [-(-n // ps) for n in lens]
    num_pages = sum(pages) + 5
    scale_k, scale_v = (0.05, 0.04) if kv_dtype == FP8 else (1.0, 1.0)
    k = torch.randn(num_pages, ps, hkv, d, generator=g, device=dev).div_(scale_k).to(kv_dtype)
    v = torch.randn(num_pages, ps, hkv, d, generator=g, device=dev).div_(scale_v).to(kv_dtype)
    order = torch.randperm(num_pages, generator=g, device=dev).int()
    table = torch.zeros(bs, max(pages) + 3, dtype=torch.int32, device=dev)
    used = 0
    for b, p in enumerate(pages):
        table[b, :p] = order[used:used + p]
        used += p
    q = torch.randn(bs, hq, d, generator=g, device=dev, dtype=torch.bfloat16)
    return q, k, v, table, torch.tensor(lens, dtype=torch.int32, device=dev), scale_k, scale_v


def lengths(bs, seed):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 1200, (bs,), generator=g).tolist()
    lens[0] = 5000  # one long request among short ones: split into pieces
    if bs > 2:
        lens[1] = 1
    return lens


def rel_err(a, b):
    a, b = a.float(), b.float()
    return (torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b)).item()


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, FP8], ids=["bf16", "fp8"])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("hq,hkv", [(32, 4), (32, 8), (16, 8), (8, 8)])
@pytest.mark.parametrize("bs", [1, 3, 64, 256])
def test_matches_reference(bs, hq, hkv, page_size, kv_dtype):
    q, k, v, table, lens, ks, vs = scene(bs, hq, hkv, 128, page_size, lengths(bs, bs + hq), kv_dtype, seed=bs)
    got = triton_decode_attention()(q, k, v, table, lens, 128 ** -0.5, ks, vs)
    want = reference(q, k, v, table, lens, 128 ** -0.5, ks, vs)
    err = rel_err(got, want)
    assert err < 1e-2, f"relative error {err:.3g} (splits {splits_for(bs, hkv)})"


@pytest.mark.parametrize("splits", [1, 2, 8, 64])
def test_every_split_count(splits):
    """The same batch under any number of pieces gives the same attention (a piece's partial sums merged)."""
    q, k, v, table, lens, ks, vs = scene(4, 32, 4, 128, 16, [5000, 1, 700, 256], torch.bfloat16, seed=7)
    got = triton_decode_attention()(q, k, v, table, lens, 128 ** -0.5, splits=splits)
    assert rel_err(got, reference(q, k, v, table, lens, 128 ** -0.5)) < 1e-2


def test_graph_replay_with_new_lengths():
    """Captured once, replayed over other lengths and pages (the splits come from the batch size alone)."""
    run = triton_decode_attention()
    q, k, v, table, lens, _, _ = scene(8, 32, 4, 128, 16, [2000] * 8, torch.bfloat16, seed=3)
    out = torch.empty_like(q)
    run(q, k, v, table, lens, 128 ** -0.5, out=out)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run(q, k, v, table, lens, 128 ** -0.5, out=out)
    for seed, new in ((4, [1, 2000, 17, 300, 256, 257, 1999, 64]), (5, [100] * 8)):
        g = torch.Generator(device="cuda").manual_seed(seed)
        lens.copy_(torch.tensor(new, dtype=torch.int32))
        table.copy_(torch.randperm(table.numel(), generator=g, device="cuda").view_as(table) % k.shape[0])
        q.copy_(torch.randn(q.shape, generator=g, device="cuda"))
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(out, reference(q, k, v, table, lens, 128 ** -0.5)) < 1e-2, new
