#!/usr/bin/env python
"""The FP8 decode GEMM alone: the small-batch Triton kernel (minisrv/kernels/fp8_gemm.py) with the launch rules'
configuration, against torch._scaled_mm's row-wise FP8 GEMM on the same operands, and the time its weight bytes
take to read (--bandwidth). Shapes: a Llama-3-8B layer's projections ([N, K]: qkv 6144 x 4096, o 4096 x 4096,
gate_up 28672 x 4096, down 4096 x 14336; with --tp 2 a rank's share; --shapes for others) at decode batch sizes
(--ms). Each product runs --iters times in a CUDA graph, cycling through weight copies that together exceed the
GPU's L2 cache (as a model's layers do); the median of --repeat replays is reported. --configs times other launch
configurations beside the rule's (block_n,block_k,num_warps,num_stages;...), to check or refine the rules.

  python scripts/bench_small_m_gemm.py [--tp 1] [--ms 1,16,32,64] [--shapes 6144x4096] [--configs 32,256,4,4]
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from graph_timing import add_timing_args, graph_us  # noqa: E402 (beside this script)

from minisrv.kernels.fp8_gemm import GemmConfig, config_for, small_m_fp8_gemm  # noqa: E402
from minisrv.kernels.fp8_quant import quantize_rows  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=int, default=1, help="the default shapes are one of this many ranks'")
    p.add_argument("--shapes", default=None, help="NxK weight shapes, comma-separated (default: Llama-3-8B's)")
    p.add_argument("--ms", default="1,16,32,64", help="rows (decode batch sizes)")
    p.add_argument("--configs", default="", help="more launch configurations to time, ';'-separated")
    p.add_argument("--cycle-bytes", type=float, default=256e6, help="weight copies cycled through, in bytes at least")
    add_timing_args(p, repeat=10)
    a = p.parse_args()
    run = small_m_fp8_gemm()
    if run is None:
        print("Triton is missing")
        return 1
    t = a.tp
    shapes = a.shapes or f"{6144 // t}x4096,4096x{4096 // t},{28672 // t}x4096,4096x{14336 // t}"
    extra = [GemmConfig(*(int(v) for v in c.split(","))) for c in a.configs.split(";") if c]
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}; us per GEMM (median of {a.repeat} x {a.iters}), % of "
          f"{a.bandwidth / 1e12:.2f} TB/s over the weight bytes")
    for shape in shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        wq, ws = quantize_rows((torch.randn(n, k, device="cuda") * 0.02).bfloat16())
        ws = ws.reshape(1, -1).contiguous()
        copies = [wq] + [wq.clone() for _ in range(max(1, -(-int(a.cycle_bytes) // (n * k))) - 1)]
        floor = n * k / a.bandwidth * 1e6
        for m in (int(v) for v in a.ms.split(",")):
            xq, xs = quantize_rows(torch.randn(m, k, device="cuda").bfloat16())
            ref = torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws, out_dtype=torch.bfloat16)
            calls = itertools.count()

            def cycled(product):
                return lambda: product(copies[next(calls) % len(copies)])
            scaled_mm = graph_us(cycled(lambda w: torch._scaled_mm(xq, w.t(), scale_a=xs, scale_b=ws,
                                                                  out_dtype=torch.bfloat16)), a.iters, a.repeat)
            rule = config_for(n, k, m)
            line = f"{shape:>11} m={m:3d}: floor {floor:5.1f} us; _scaled_mm {scaled_mm:6.1f}"
            for c in [rule] + [c for c in extra if c != rule and k % c.block_k == 0]:
                out = run(xq, xs, wq, ws, config=c, raise_errors=True)
                diff = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
                us = graph_us(cycled(lambda w, c=c: run(xq, xs, w, ws, config=c, raise_errors=True)),
                              a.iters, a.repeat)
                line += (f"; {'rule ' if c == rule else ''}{tuple(c)} {us:6.1f} ({100 * floor / us:3.0f}%, "
                         f"{scaled_mm / us:4.2f}x, diff {diff:.0e})")
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
