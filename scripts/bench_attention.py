#!/usr/bin/env python
"""Decode attention kernels alone, over one layer of a paged KV cache: time per call against the bytes they must
read (every request's K and V once), and each output against a float32 reference on the same cache contents.

Kernels: FlashInfer's decode wrapper (CUDA-core and tensor-core variants), FlashAttention-3 (`fa3`; with an FP8
cache it takes q in e4m3 too) and FlashInfer's XQA (`xqa`, TensorRT-LLM's decode kernel; Hopper's FP8 path is its own
kernel) and minisrv's Triton decode kernel (`triton`: its launch rule; `triton:splits=2/tile=128/num_warps=8`:
other launch parameters, those of its launcher). The cache has --context tokens a request in pages of --page-size,
the pages of all requests shuffled, as a
pool's are after a while. Each kernel runs --iters times in a CUDA graph; the median of --repeat graph replays is
reported.

  python scripts/bench_attention.py --heads 16,8 --batch-sizes 64,256 --context 1024 --kv-dtypes bf16,fp8
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from graph_timing import add_timing_args, graph_us  # noqa: E402 (beside this script)

FP8 = torch.float8_e4m3fn


def reference(q, k_cache, v_cache, page_table, seq_len, scale, k_scale, v_scale):
    """float32 attention of each request's q over its pages (dequantised with the scales)."""
    b, hq, d = q.shape
    pages = page_table.shape[1]
    k = k_cache[page_table.long()].float().reshape(b, pages * k_cache.shape[1], -1, d)[:, :seq_len] * k_scale
    v = v_cache[page_table.long()].float().reshape(b, pages * v_cache.shape[1], -1, d)[:, :seq_len] * v_scale
    group = hq // k.shape[2]
    k, v = k.repeat_interleave(group, 2), v.repeat_interleave(group, 2)
    s = torch.einsum("bhd,bthd->bht", q.float(), k) * scale
    return torch.einsum("bht,bthd->bhd", s.softmax(-1), v)


def kernels(q, k_cache, v_cache, page_table, seq_lens, scale, k_scale, v_scale, page_size, kv_dtype, wanted=()):
    """name -> a call that writes its output into a fixed tensor (CUDA-graph safe), for every kernel available."""
    import flashinfer

    from minisrv.kernels.decode_attention import triton_decode_attention
    b, hq, d = q.shape
    hkv = k_cache.shape[2]
    dev = q.device
    out = {}
    workspace = torch.zeros(256 << 20, dtype=torch.uint8, device=dev)
    pages = page_table.shape[1]
    indptr = torch.arange(0, (b + 1) * pages, pages, dtype=torch.int32, device=dev)
    indices = page_table.reshape(-1).contiguous()
    last = torch.full((b,), (seq_lens[0].item() - 1) % page_size + 1, dtype=torch.int32, device=dev)
    for tc in (False, True):
        w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=tc)
        w.plan(indptr, indices, last, hq, hkv, d, page_size, pos_encoding_mode="NONE", q_data_type=q.dtype,
               kv_data_type=kv_dtype, sm_scale=scale)
        o = torch.empty_like(q)
        out["fi-tc" if tc else "fi"] = (lambda w=w, o=o: w.run(q, (k_cache, v_cache), k_scale=k_scale,
                                                                v_scale=v_scale, out=o), o)
    try:
        from minisrv.attention.fa import load_kernel
        fa = load_kernel()
        o3 = torch.empty_like(q)
        if kv_dtype == FP8:
            q8 = q.to(FP8)
            desc = {"k_descale": torch.full((b, hkv), k_scale, device=dev),
                    "v_descale": torch.full((b, hkv), v_scale, device=dev)}
        else:
            q8, desc = q, {}

        def run_fa3():
            o3.copy_(fa(q=q8.unsqueeze(1), k_cache=k_cache, v_cache=v_cache, cache_seqlens=seq_lens,
                        page_table=page_table, softmax_scale=scale, causal=True, **desc).squeeze(1))
        out["fa3"] = (run_fa3, o3)
    except Exception as e:  # noqa: BLE001
        print(f"  fa3 unavailable: {type(e).__name__}: {e}")
    for name in ("triton", *[w for w in wanted if w.startswith("triton:")]):
        ot = torch.empty_like(q)
        extra = {k: int(v) for k, v in (kv.split("=") for kv in name.split(":")[1].split("/"))} if ":" in name else {}
        out[name] = (lambda ot=ot, extra=extra: triton_decode_attention()(
            q, k_cache, v_cache, page_table, seq_lens, scale, k_scale, v_scale, out=ot, **extra), ot)
    try:
        from flashinfer.decode import xqa_batch_decode_with_kv_cache
        ox = torch.empty_like(q)
        xws = torch.zeros(256 << 20, dtype=torch.uint8, device=dev)
        useq = seq_lens.to(torch.uint32) if hasattr(torch, "uint32") else seq_lens

        def run_xqa():
            xqa_batch_decode_with_kv_cache(q, (k_cache, v_cache), xws, page_table, useq, pages * page_size,
                                           bmm1_scale=scale * k_scale, bmm2_scale=v_scale, out=ox,
                                           kv_layout="NHD")
        out["xqa"] = (run_xqa, ox)
    except Exception as e:  # noqa: BLE001
        print(f"  xqa unavailable: {type(e).__name__}: {e}")
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--heads", default="16,8;32,8", help="q,kv head pairs separated by ';'")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--batch-sizes", default="64,256")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--kv-dtypes", default="bf16,fp8")
    p.add_argument("--kernels", default="fi,fi-tc,fa3,xqa,triton")
    add_timing_args(p, repeat=20)
    a = p.parse_args()
    torch.manual_seed(0)
    dev = torch.device("cuda")
    d, ps, ctx = a.head_dim, a.page_size, a.context
    wanted = a.kernels.split(",")
    print(f"{torch.cuda.get_device_name()}; context {ctx}, page size {ps}, head dim {d}; "
          f"us per layer call (median of {a.repeat} x {a.iters}), % of {a.bandwidth / 1e12:.2f} TB/s, "
          f"max |out - float32 reference|")
    for pair in a.heads.split(";"):
        hq, hkv = (int(x) for x in pair.split(","))
        for bs in (int(x) for x in a.batch_sizes.split(",")):
            for name in a.kv_dtypes.split(","):
                kv_dtype = FP8 if name == "fp8" else torch.bfloat16
                pages = (ctx + ps - 1) // ps
                num_pages = bs * pages + 7
                k_scale, v_scale = (0.05, 0.04) if kv_dtype == FP8 else (1.0, 1.0)
                k_cache = torch.randn(num_pages, ps, hkv, d, device=dev).div_(k_scale).to(kv_dtype)
                v_cache = torch.randn(num_pages, ps, hkv, d, device=dev).div_(v_scale).to(kv_dtype)
                page_table = torch.randperm(num_pages, device=dev)[:bs * pages].to(torch.int32).view(bs, pages)
                seq_lens = torch.full((bs,), ctx, dtype=torch.int32, device=dev)
                q = torch.randn(bs, hq, d, device=dev, dtype=torch.bfloat16)
                scale = d ** -0.5
                ref = reference(q, k_cache, v_cache, page_table, ctx, scale, k_scale, v_scale)
                nbytes = 2 * bs * ctx * hkv * d * k_cache.element_size()
                floor_us = nbytes / a.bandwidth * 1e6
                line = f"heads {hq}/{hkv} batch {bs:3d} KV {name:4s} floor {floor_us:6.1f} us:"
                for kname, (fn, o) in kernels(q, k_cache, v_cache, page_table, seq_lens, scale, k_scale,
                                              v_scale, ps, kv_dtype, wanted).items():
                    if kname not in wanted:
                        continue
                    try:
                        us = graph_us(fn, a.iters, a.repeat)
                        err = (o.float() - ref).abs().max().item()
                        line += f"  {kname} {us:6.1f} ({100 * floor_us / us:3.0f}%, err {err:.1e})"
                    except Exception as e:  # noqa: BLE001
                        line += f"  {kname} failed ({type(e).__name__}: {str(e)[:80]})"
                print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
