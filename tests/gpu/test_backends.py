"""The fast attention backends (fa, fi, the triton decode half and their hybrids) against the torch reference,
on a CUDA GPU.

Every case builds a paged pool whose pages are handed out in a shuffled order (so requests' pages are not
contiguous), fills each request's cached prefix with random K/V, runs one step through the backend under test and
through the torch backend on an identical copy of the pool, and compares both the attention outputs and what each
wrote into its pool. Models with sliding windows and soft-capped scores (attention_options.py) are run the same way,
their options given to both backends.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import pytest
import torch

from minisrv.attention import create_backend
from minisrv.batch import ForwardBatch, ForwardMode
from minisrv.attention.torch_native import TorchNativeBackend
from minisrv.kvcache import KVPool, PageAllocator, slots_for
from minisrv.models.attention_options import LayerAttention

from .common import skip_unless_runs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

NUM_LAYERS = 2
MAX_CONTEXT = 512
NUM_ROWS = 8
POOL_TOKENS = 4096
PREFIX_LENS = [0, 7, 33, 100, 250]
EXTEND_LENS = [17, 1, 40, 64, 9]
# (q heads, kv heads, head_dim, dtype): GQA groups 4 (FlashInfer decodes on tensor cores) and 2 (CUDA cores),
# MQA (group 8), head_dim 128 and 64, bf16 and fp16. Each (dtype, head_dim) pair is a kernel build of its own
# (minutes for FlashInfer), so the pairs are covered once each rather than crossed with every head layout.
CONFIGS = [(32, 8, 128, torch.bfloat16), (32, 8, 128, torch.float16), (16, 8, 128, torch.bfloat16),
           (8, 1, 64, torch.bfloat16), (16, 2, 64, torch.float16)]
CONFIG_IDS = [f"{hq}-{hkv}-{d}-{'bf16' if dt is torch.bfloat16 else 'fp16'}" for hq, hkv, d, dt in CONFIGS]
TOL = 1e-2
# Gemma-like layers: a window of 32 tokens (shorter than most test sequences), soft-capped, with a scale of its own;
# then a global soft-capped layer
WINDOWED = (LayerAttention(0.06, window=32, softcap=2.0), LayerAttention(0.06, softcap=2.0))
WINDOWS_ONLY = (LayerAttention(0.06, window=32), LayerAttention(0.06))  # fa serves windows, not soft-capping


def _options_for(name: str):
    return WINDOWS_ONLY if name.split(",")[0] == "fa" else WINDOWED


def _dev() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality, for any dtype (float8 tensors have no equality kernels everywhere)."""
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _written(pool: KVPool, layer: int, loc: torch.Tensor) -> torch.Tensor:
    """The bytes of K and V at slots `loc` of one layer, [2, T, Hkv, D * itemsize]."""
    return pool.kv[layer].view(2, -1, pool.num_kv_heads, pool.head_dim).view(torch.uint8)[:, loc]


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return (torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b).clamp_min(1e-12)).item()


class Scene:
    """A pool, a request->token table and requests whose pages come from a shuffled allocator."""

    def __init__(self, page_size: int, dtype: torch.dtype, hkv: int, d: int, seed: int = 0,
                 kv_dtype: Optional[torch.dtype] = None) -> None:
        self.dev = _dev()
        self.page_size = page_size
        self.gen = torch.Generator().manual_seed(seed)
        num_pages = -(-POOL_TOKENS // page_size)
        self.pool = KVPool(NUM_LAYERS, num_pages, page_size, hkv, d, dtype, self.dev, kv_dtype)
        self.table = torch.zeros((NUM_ROWS, MAX_CONTEXT), dtype=torch.int32, device=self.dev)
        self.alloc = PageAllocator(num_pages)
        everything = self.alloc.alloc(num_pages)
        perm = torch.randperm(num_pages, generator=self.gen).tolist()
        self.alloc.free([everything[i] for i in perm])  # the free stack now hands pages out in random order
        self.slots = {}  # row -> [length] int64 slots on the host

    def add_request(self, row: int, length: int) -> None:
        pages = self.alloc.alloc(-(-length // self.page_size))
        slots = slots_for(pages, self.page_size, 0, length)
        self.slots[row] = slots
        self.table[row, :length] = slots.to(torch.int32).to(self.dev)

    def randn(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen).to(self.dev, self.pool.dtype)

    def fill(self, row: int, end: int) -> None:
        """Random K/V for positions [0, end) of `row`, in every layer."""
        if end == 0:
            return
        loc = self.slots[row][:end].to(self.dev)
        h, d = self.pool.num_kv_heads, self.pool.head_dim
        for layer in range(NUM_LAYERS):
            self.pool.store(layer, loc, self.randn(end, h, d), self.randn(end, h, d))

    def clone_pool(self) -> KVPool:
        p = self.pool
        twin = KVPool(p.num_layers, p.num_pages, p.page_size, p.num_kv_heads, p.head_dim, p.dtype, p.device,
                      p.kv_dtype)
        twin.set_scales(p.k_scale_host, p.v_scale_host)
        for layer in range(p.num_layers):
            twin.kv[layer].view(torch.uint8).copy_(p.kv[layer].view(torch.uint8))
        return twin

    def batch(self, mode: ForwardMode, rows: Sequence[int], cached: Sequence[int],
              new: Sequence[int]) -> ForwardBatch:
        return make_batch(mode, rows, cached, new, [self.slots[r] for r in rows], self.dev)


def make_batch(mode: ForwardMode, rows: Sequence[int], cached: Sequence[int], new: Sequence[int],
               row_slots: Sequence[torch.Tensor], dev: torch.device) -> ForwardBatch:
    """A consistent ForwardBatch: request i has `cached[i]` tokens in the pool and adds `new[i]` this step."""
    assert len(rows) == len(cached) == len(new)
    if mode is ForwardMode.DECODE:
        assert all(n == 1 for n in new)
    seq = [c + n for c, n in zip(cached, new)]
    positions = torch.cat([torch.arange(c, c + n, dtype=torch.int64) for c, n in zip(cached, new)])
    loc = torch.cat([s[c:c + n] for s, c, n in zip(row_slots, cached, new)]).to(torch.int64)
    cu = torch.zeros(len(rows) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(new, dtype=torch.int32), 0)
    return ForwardBatch(
        mode=mode,
        input_ids=torch.zeros(int(cu[-1]), dtype=torch.int64, device=dev),
        positions=positions.to(dev),
        out_cache_loc=loc.to(dev),
        req_rows=torch.tensor(list(rows), dtype=torch.int64, device=dev),
        seq_lens=torch.tensor(seq, dtype=torch.int32, device=dev),
        cu_seqlens_q=cu.to(dev),
        logit_rows=(cu[1:].to(torch.int64) - 1).to(dev),
        seq_lens_cpu=seq,
        extend_lens_cpu=list(new),
        max_seq_len=max(seq),
    )


def _run(backend, batch: ForwardBatch, qkv) -> List[torch.Tensor]:
    meta = backend.prepare(batch)
    return [backend.forward(q, k, v, layer, meta) for layer, (q, k, v) in enumerate(qkv)]


def _fused_views(qkv: torch.Tensor, hq: int, hkv: int, d: int):
    """q, k, v as the model passes them: strided views of one [T, (Hq + 2 Hkv) D] projection output (a kernel that
    reads q as if it were contiguous reads other tokens' values)."""
    t = qkv.shape[0]
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    return q.reshape(t, hq, d), k.reshape(t, hkv, d), v.reshape(t, hkv, d)


def run_against_torch(name: str, mode: ForwardMode, page_size: int, dtype: torch.dtype, hq: int, hkv: int, d: int,
                      kv_dtype: Optional[torch.dtype] = None, scales=None, fp8_decode_kernel: str = "flashinfer",
                      layers: Optional[Sequence[LayerAttention]] = None):
    """One extend (on cached prefixes) or decode step of every layer through backend `name` and through the torch
    backend on a copy of the pool (of `kv_dtype`, with `scales` for an FP8 one). Returns (scene, the copy, outputs,
    the torch backend's outputs, tokens in the step), each output a list over the layers."""
    skip_unless_runs(name)
    sc = Scene(page_size, dtype, hkv, d, kv_dtype=kv_dtype)
    if scales is not None:
        sc.pool.set_scales(*scales)
    rows = list(range(len(PREFIX_LENS)))
    if mode is ForwardMode.EXTEND:
        cached, new = PREFIX_LENS, EXTEND_LENS
    else:
        cached, new = [p + e for p, e in zip(PREFIX_LENS, EXTEND_LENS)], [1] * len(PREFIX_LENS)
    for r, c, n in zip(rows, cached, new):
        sc.add_request(r, c + n)
        sc.fill(r, c)
    batch = sc.batch(mode, rows, cached, new)
    t = batch.num_tokens
    qkv = [_fused_views(sc.randn(t, (hq + 2 * hkv) * d), hq, hkv, d) for _ in range(NUM_LAYERS)]

    ref_pool = sc.clone_pool()
    backend = create_backend(name, sc.pool, sc.table, hq, fp8_decode_kernel, layers)
    out = _run(backend, batch, qkv)
    ref = _run(TorchNativeBackend(ref_pool, sc.table, hq, layers), batch, qkv)
    torch.cuda.synchronize()
    return sc, ref_pool, out, ref, t


@pytest.mark.parametrize("hq,hkv,d,dtype", CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.DECODE], ids=["extend", "decode"])
@pytest.mark.parametrize("name", ["fa", "fi", "fa,fi", "fi,fa", "fa,triton"])
def test_matches_torch(name, mode, page_size, dtype, hq, hkv, d):
    sc, ref_pool, out, ref, t = run_against_torch(name, mode, page_size, dtype, hq, hkv, d)
    for layer in range(NUM_LAYERS):
        assert out[layer].shape == (t, hq, d)
        err = _rel_err(out[layer], ref[layer])
        assert err < TOL, f"layer {layer}: relative error {err:.3g}"
        assert same_bytes(sc.pool.k[layer], ref_pool.k[layer])
        assert same_bytes(sc.pool.v[layer], ref_pool.v[layer])


@pytest.mark.parametrize("hq,hkv,d", [(32, 8, 128), (16, 8, 128)])  # fi: tensor-core and CUDA-core decode
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("name", ["fa", "fi", "fa,triton"])
def test_cuda_graph_decode(name, page_size, hq, hkv, d):
    """Capture decode at bs 4 and 8 on static buffers, then replay real batches padded up to them."""
    check_cuda_graph_decode(name, page_size, hq, hkv, d)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.DECODE], ids=["extend", "decode"])
@pytest.mark.parametrize("name", ["fa", "fi", "fa,fi"])
def test_windows_and_softcap_match_torch(name, mode, page_size):
    hq, hkv, d = 16, 8, 128
    sc, ref_pool, out, ref, t = run_against_torch(name, mode, page_size, torch.bfloat16, hq, hkv, d,
                                                  layers=_options_for(name))
    plain = run_against_torch("torch", mode, page_size, torch.bfloat16, hq, hkv, d)[3]
    for layer in range(NUM_LAYERS):
        err = _rel_err(out[layer], ref[layer])
        assert err < TOL, f"layer {layer}: relative error {err:.3g}"
        assert _rel_err(plain[layer], ref[layer]) > 10 * TOL, "the options should change the output"


@pytest.mark.parametrize("name", ["fa", "fi"])
def test_cuda_graph_decode_with_windows_and_softcap(name):
    check_cuda_graph_decode(name, 16, 32, 8, 128, layers=_options_for(name))


def check_cuda_graph_decode(name: str, page_size: int, hq: int, hkv: int, d: int,
                            kv_dtype: Optional[torch.dtype] = None, scales=None, tol: float = TOL,
                            fp8_decode_kernel: str = "flashinfer",
                            layers: Optional[Sequence[LayerAttention]] = None) -> None:
    """Graph replays against the torch backend on a copy of the pool; `scales` ((k, v) per layer) for FP8 pools."""
    skip_unless_runs(name)
    dtype = torch.bfloat16
    sc = Scene(page_size, dtype, hkv, d, seed=1, kv_dtype=kv_dtype)
    if scales is not None:
        sc.pool.set_scales(*scales)
    dev = sc.dev
    rows = list(range(len(PREFIX_LENS)))
    cached = [p + e for p, e in zip(PREFIX_LENS, EXTEND_LENS)]
    for r, c in zip(rows, cached):
        sc.add_request(r, c + 1)
        sc.fill(r, c)
    dummy_row = NUM_ROWS - 1  # padding rows point here: one valid slot that no real request uses
    sc.add_request(dummy_row, 1)
    dummy_slot = int(sc.slots[dummy_row][0])

    backend = create_backend(name, sc.pool, sc.table, hq, fp8_decode_kernel, layers)
    assert backend.supports_cuda_graph
    max_bs = 8
    backend.init_graph_state(max_bs, MAX_CONTEXT)

    # the model runner's static inputs; a captured batch size uses their leading rows
    q_s = [torch.zeros(max_bs, hq, d, dtype=dtype, device=dev) for _ in range(NUM_LAYERS)]
    k_s = [torch.zeros(max_bs, hkv, d, dtype=dtype, device=dev) for _ in range(NUM_LAYERS)]
    v_s = [torch.zeros(max_bs, hkv, d, dtype=dtype, device=dev) for _ in range(NUM_LAYERS)]
    loc_s = torch.full((max_bs,), dummy_slot, dtype=torch.int64, device=dev)
    rows_s = torch.full((max_bs,), dummy_row, dtype=torch.int64, device=dev)
    seq_s = torch.ones(max_bs, dtype=torch.int32, device=dev)
    cu_s = torch.arange(max_bs + 1, dtype=torch.int32, device=dev)
    idx_s = torch.arange(max_bs, dtype=torch.int64, device=dev)
    zeros_s = torch.zeros(max_bs, dtype=torch.int64, device=dev)

    graphs, outs, metas = {}, {}, {}
    for bs in (4, 8):
        cap = ForwardBatch(mode=ForwardMode.DECODE, input_ids=zeros_s[:bs], positions=zeros_s[:bs],
                           out_cache_loc=loc_s[:bs], req_rows=rows_s[:bs], seq_lens=seq_s[:bs],
                           cu_seqlens_q=cu_s[:bs + 1], logit_rows=idx_s[:bs], seq_lens_cpu=[1] * bs,
                           extend_lens_cpu=[1] * bs, max_seq_len=1)
        metas[bs] = meta = backend.prepare_for_capture(cap)

        def body(bs=bs, meta=meta):
            return [backend.forward(q_s[l][:bs], k_s[l][:bs], v_s[l][:bs], l, meta) for l in range(NUM_LAYERS)]

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            body()  # warm-up outside capture: lazy module loads and cached buffers happen here
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            outs[bs] = body()
        graphs[bs] = g

    for real_rows, padded_bs in (([0, 1, 2, 3, 4], 8), ([3, 1, 4], 4), ([2, 0], 8), ([4, 3, 2, 1], 4)):
        n = len(real_rows)
        batch = sc.batch(ForwardMode.DECODE, real_rows, [cached[r] for r in real_rows], [1] * n)
        qkv = [(sc.randn(n, hq, d), sc.randn(n, hkv, d), sc.randn(n, hkv, d)) for _ in range(NUM_LAYERS)]
        ref_pool = sc.clone_pool()
        ref = _run(TorchNativeBackend(ref_pool, sc.table, hq, layers), batch, qkv)

        for layer, (q, k, v) in enumerate(qkv):
            q_s[layer].zero_()
            k_s[layer].zero_()
            v_s[layer].zero_()
            q_s[layer][:n].copy_(q)
            k_s[layer][:n].copy_(k)
            v_s[layer][:n].copy_(v)
        loc_s.fill_(dummy_slot)
        loc_s[:n].copy_(batch.out_cache_loc)
        backend.prepare_for_replay(batch, padded_bs, metas[padded_bs])
        graphs[padded_bs].replay()
        torch.cuda.synchronize()

        loc = batch.out_cache_loc
        for layer in range(NUM_LAYERS):
            got = outs[padded_bs][layer]
            assert got.shape == (padded_bs, hq, d)
            assert torch.isfinite(got.float()).all()
            err = _rel_err(got[:n], ref[layer])
            assert err < tol, f"rows {real_rows} padded to {padded_bs}, layer {layer}: relative error {err:.3g}"
            assert torch.equal(_written(sc.pool, layer, loc), _written(ref_pool, layer, loc))


