"""The Triton decode-attention kernel (minisrv/kernels/decode_attention.py) run by Triton's interpreter on the CPU
(TRITON_INTERPRET=1 is set before Triton is imported: hence a script of its own, run in a fresh process by
tests/test_decode_attention.py). It checks the kernel's paging, splitting and merging, GQA grouping, masking of a
partial last tile and FP8 scaling against `reference` (float32 softmax in torch) and against float64 attention
written out here. float16 operands: the interpreter's bfloat16 products are not the GPU's. Prints a line per check
and "ok" at the end; raises AssertionError on the first failure.
"""
from __future__ import annotations

import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from minisrv.kernels.decode_attention import MIN_CHUNK, reference, splits_for, triton_decode_attention  # noqa: E402


def float64_attention(q, k_cache, v_cache, table, lens, scale, k_scale, v_scale):
    """Attention of each request's one query over its tokens, in float64, from the pages as a plain gather."""
    bs, hq, d = q.shape
    ps, hkv = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty(bs, hq, d, dtype=torch.float64)
    for b in range(bs):
        n = int(lens[b])
        slots = [int(table[b, p // ps]) * ps + p % ps for p in range(n)]
        k = k_cache.reshape(-1, hkv, d)[slots].double() * k_scale
        v = v_cache.reshape(-1, hkv, d)[slots].double() * v_scale
        for h in range(hq):
            g = h // (hq // hkv)
            w = torch.softmax(k[:, g] @ q[b, h].double() * scale, dim=0)
            out[b, h] = w @ v[:, g]
    return out


def scene(bs, hq, hkv, d, ps, lens, kv_dtype, seed):
    """Random q and a pool whose pages are handed out shuffled, so that each request's tokens are scattered."""
    g = torch.Generator().manual_seed(seed)
    pages_needed = sum(-(-n // ps) for n in lens)
    num_pages = pages_needed + 3
    k_cache = torch.randn(num_pages, ps, hkv, d, generator=g)
    v_cache = torch.randn(num_pages, ps, hkv, d, generator=g)
    if kv_dtype == torch.float8_e4m3fn:
        k_cache, v_cache = (k_cache * 40).to(kv_dtype), (v_cache * 40).to(kv_dtype)
    else:
        k_cache, v_cache = k_cache.to(kv_dtype), v_cache.to(kv_dtype)
    order = torch.randperm(num_pages, generator=g)
    max_pages = max(-(-n // ps) for n in lens) + 2
    table = torch.zeros(bs, max_pages, dtype=torch.int32)
    used = 0
    for b, n in enumerate(lens):
        p = -(-n // ps)
        table[b, :p] = order[used:used + p].int()
        used += p
    q = torch.randn(bs, hq, d, generator=g).to(torch.float16)
    return q, k_cache, v_cache, table, torch.tensor(lens, dtype=torch.int32)


def check_decode_attention() -> None:
    run = triton_decode_attention()
    assert run is not None
    cases = [
        # (bs, hq, hkv, d, page size, lengths, splits, kv dtype)
        (3, 8, 2, 32, 16, [1, 17, 64], None, torch.float16),  # one piece each; partial tiles and pages
        (2, 4, 4, 16, 1, [5, 130], 1, torch.float16),  # no grouping, page size 1
        (2, 16, 2, 32, 16, [MIN_CHUNK * 2 + 37, 40], 4, torch.float16),  # the first split in 3 pieces, merged
        (1, 12, 4, 32, 8, [MIN_CHUNK * 3 + 1], 8, torch.float16),  # group of 3 padded to 16 rows; a 1-token piece
        (2, 8, 1, 32, 16, [MIN_CHUNK + 5, 9], 2, torch.float8_e4m3fn),  # FP8 pool with scales, split and whole
    ]
    for i, (bs, hq, hkv, d, ps, lens, splits, kv_dtype) in enumerate(cases):
        q, k_cache, v_cache, table, seq_lens = scene(bs, hq, hkv, d, ps, lens, kv_dtype, seed=i)
        scale, k_scale, v_scale = d ** -0.5, 1.0, 1.0
        if kv_dtype == torch.float8_e4m3fn:
            k_scale, v_scale = 1 / 40, 1 / 40
        got = run(q, k_cache, v_cache, table, seq_lens, scale, k_scale, v_scale, splits=splits)
        want = reference(q, k_cache, v_cache, table, seq_lens, scale, k_scale, v_scale)
        exact = float64_attention(q, k_cache, v_cache, table, seq_lens, scale, k_scale, v_scale)
        torch.testing.assert_close(want.double(), exact, rtol=2e-3, atol=2e-3)  # the reference itself
        torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)
        err = (got.double() - exact).abs().max().item()
        print(f"decode attention bs {bs} hq {hq} hkv {hkv} d {d} page {ps} lens {lens} splits "
              f"{splits or splits_for(bs, hkv)} {kv_dtype}: max error {err:.1e} against float64")
    # a q with strided rows (a view of a fused qkv output), as the model hands it
    q, k_cache, v_cache, table, seq_lens = scene(2, 8, 2, 32, 16, [300, 20], torch.float16, seed=9)
    wide = torch.zeros(2, 8 + 4, 32, dtype=torch.float16)
    wide[:, :8] = q
    got = run(wide[:, :8], k_cache, v_cache, table, seq_lens, 32 ** -0.5, splits=2)
    torch.testing.assert_close(got, reference(q, k_cache, v_cache, table, seq_lens, 32 ** -0.5), rtol=2e-3,
                               atol=2e-3)
    print("decode attention: strided q as contiguous")


if __name__ == "__main__":
    check_decode_attention()
    print("ok")
