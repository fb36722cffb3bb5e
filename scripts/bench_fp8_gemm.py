#!/usr/bin/env python
"""The FP8 decode GEMM alone: the small-batch Triton kernel (minisrv/models/fp8.py) over a sweep of its launch
parameters, against cuBLAS's row-wise FP8 GEMM (`torch._scaled_mm`) and the bytes it must read (the weights once).

Shapes are a Llama-3-8B layer's projections ([N, K]: qkv 6144 x 4096, o 4096 x 4096, gate_up 28672 x 4096, down
4096 x 14336; --shapes for others) at decode batch sizes (--ms). Each configuration runs --iters times in a CUDA
graph; the median of --repeat replays is reported, with the best configuration per shape and batch size, the
default one (`default_small_m_config`), and the best one's relative difference from cuBLAS's output.

  python scripts/bench_fp8_gemm.py [--ms 1,16,64] [--shapes 6144x4096,4096x14336]
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from graph_timing import add_timing_args, graph_us  # noqa: E402 (beside this script)

from minisrv.models.fp8 import SmallMConfig, _triton_small_m_gemm, default_small_m_config, quantize_rows  # noqa: E402

LLAMA_8B = "6144x4096,4096x4096,28672x4096,4096x14336"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=LLAMA_8B, help="NxK weight shapes, comma-separated")
    p.add_argument("--ms", default="1,16,64", help="rows (decode batch sizes)")
    p.add_argument("--block-n", default="16,32,64")
    p.add_argument("--block-k", default="128,256")
    p.add_argument("--num-warps", default="2,4,8")
    p.add_argument("--num-stages", default="3,4,5")
    add_timing_args(p, repeat=10)
    a = p.parse_args()
    ints = lambda text: [int(x) for x in text.split(",")]  # noqa: E731
    small = _triton_small_m_gemm()
    if small is None:
        print("Triton is missing: nothing to sweep")
        return 1
    configs = [SmallMConfig(*c) for c in itertools.product(ints(a.block_n), ints(a.block_k), ints(a.num_warps),
                                                           ints(a.num_stages))]
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}; us per GEMM (median of {a.repeat} x {a.iters}), % of "
          f"{a.bandwidth / 1e12:.2f} TB/s over the weight bytes; {len(configs)} configurations")
    for shape in a.shapes.split(","):
        n, k = (int(x) for x in shape.split("x"))
        w = (torch.randn(n, k, device="cuda") * 0.02).bfloat16()
        wq, ws = quantize_rows(w)
        ws = ws.reshape(1, -1).contiguous()
        floor = n * k / a.bandwidth * 1e6
        for m in ints(a.ms):
            xq, xs = quantize_rows(torch.randn(m, k, device="cuda").bfloat16())
            ref = torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws, out_dtype=torch.bfloat16)
            cublas = graph_us(lambda: torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws, out_dtype=torch.bfloat16),
                           a.iters, a.repeat)
            default = default_small_m_config(n, k, m)
            results = {}
            for c in configs:
                if k % c.block_k:
                    continue
                try:
                    results[c] = graph_us(lambda c=c: small(xq, xs, wq, ws, c, raise_errors=True), a.iters, a.repeat)
                except Exception as e:  # noqa: BLE001 - e.g. more shared memory than the GPU has
                    print(f"  {shape} m={m} {c}: {type(e).__name__}")
            best = min(results, key=results.get)
            out = small(xq, xs, wq, ws, best, raise_errors=True)
            diff = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
            pct = lambda us: f"{us:6.1f} us ({100 * floor / us:3.0f}%)"  # noqa: E731
            print(f"{shape:>11} m={m:3d}: floor {floor:6.1f} us; cuBLAS {pct(cublas)}; "
                  f"default {tuple(default)} {pct(results.get(default, float('nan')))}; "
                  f"best {tuple(best)} {pct(results[best])} (from cuBLAS {diff:.1e})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
