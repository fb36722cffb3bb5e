#!/usr/bin/env python
"""The W4A16 GEMM alone (minisrv/kernels/w4a16_gemm.py) with the launch rules' configuration, against the bf16
matmul of the same (dequantised) weight, and the time its 4-bit bytes (weights, scales and zeros) take to read
(--bandwidth). Shapes: a Llama-3-8B layer's projections ([N, K]: qkv 6144 x 4096, o 4096 x 4096, gate_up 28672 x
4096, down 4096 x 14336; with --tp 2 a rank's share; --shapes for others) at batch sizes --ms, in groups of --group
rows of K (0: one per output channel). Each product runs --iters times in a CUDA graph, cycling through weight
copies that together exceed the GPU's L2 cache (as a model's layers do); the median of --repeat replays is reported.
Each line also gives the kernel's error against the bf16 matmul (relative, Frobenius). --configs times other launch
configurations beside the rule's (block_m,block_n,block_k,split_k,num_warps,num_stages;...; block_m under 16: the
CUDA cores' kernel, which takes at most block_m rows; block_m 0: the weight dequantised for torch's matmul; one the
GPU cannot hold is reported as failed).

  python scripts/bench_w4a16.py [--tp 1] [--ms 1,16,64,256] [--group 128] [--configs 16,64,128,4,4,3]
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from graph_timing import add_timing_args, graph_us  # noqa: E402 (beside this script)

from minisrv.kernels.w4a16_gemm import W4A16Config, config_for, dequantize, pack_rows, w4a16_gemm  # noqa: E402


def random_int4(n: int, k: int, group: int):
    """(qweight int32 [K/8, N], scales fp16 [K/G, N], zeros uint8 [K/G, N]) of a random weight, on the GPU."""
    groups = k // (group or k)
    values = torch.randint(0, 16, (k, n), dtype=torch.uint8, device="cuda")
    scales = (torch.rand(groups, n, device="cuda") * 0.004 + 0.001).half()
    zeros = torch.randint(0, 16, (groups, n), dtype=torch.uint8, device="cuda")
    return pack_rows(values), scales, zeros


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=int, default=1, help="the default shapes are one of this many ranks'")
    p.add_argument("--shapes", default=None, help="NxK weight shapes, comma-separated (default: Llama-3-8B's)")
    p.add_argument("--ms", default="1,16,64,256", help="rows (batch sizes)")
    p.add_argument("--group", type=int, default=128, help="rows of K a scale covers (0: per output channel)")
    p.add_argument("--configs", default="", help="more launch configurations to time, ';'-separated")
    p.add_argument("--cycle-bytes", type=float, default=256e6, help="weight copies cycled through, in bytes at least")
    add_timing_args(p, repeat=10)
    a = p.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 1
    run = w4a16_gemm()
    if run is None:
        print("Triton is missing")
        return 1
    t = a.tp
    shapes = a.shapes or f"{6144 // t}x4096,4096x{4096 // t},{28672 // t}x4096,4096x{14336 // t}"
    extra = [W4A16Config(*(int(v) for v in c.split(","))) for c in a.configs.split(";") if c]
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}; group {a.group or 'per channel'}; us per GEMM (median of {a.repeat} x "
          f"{a.iters}); floor: the 4-bit weight's bytes at {a.bandwidth / 1e12:.2f} TB/s")
    total = {}
    for shape in shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        q4 = random_int4(n, k, a.group)
        w16 = dequantize(*q4).to(torch.bfloat16)  # [K, N]
        w16_t = w16.t().contiguous()  # [N, K], as nn.Linear holds it
        bytes4 = sum(x.numel() * x.element_size() for x in q4)
        copies4 = [q4] + [tuple(x.clone() for x in q4) for _ in range(max(1, -(-int(a.cycle_bytes) // bytes4)) - 1)]
        copies16 = [w16_t] + [w16_t.clone() for _ in range(max(1, -(-int(a.cycle_bytes) // (2 * n * k))) - 1)]
        floor = bytes4 / a.bandwidth * 1e6
        for m in (int(v) for v in a.ms.split(",")):
            x = (torch.randn(m, k, device="cuda") * 0.5).bfloat16()
            ref = x @ w16
            calls = itertools.count()
            bf16 = graph_us(lambda: torch.nn.functional.linear(x, copies16[next(calls) % len(copies16)]),
                            a.iters, a.repeat)
            rule = config_for(m, n, k, a.group or k)
            line = f"{shape:>11} m={m:4d}: floor {floor:6.1f} us; bf16 {bf16:7.1f}"
            # (a CUDA-cores configuration takes at most its block_m rows; block_m 0 dequantises for torch's matmul)
            configs = [rule] + [c for c in extra if c != rule and (c.block_m in (0, m) or c.block_m >= 16)]
            for c in configs:
                try:
                    out = run(x, *q4, config=c)
                except Exception as e:  # (a configuration the GPU cannot hold: shared memory)
                    line += f"; {tuple(c)} failed: {type(e).__name__}"
                    continue
                diff = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
                us = graph_us(lambda c=c: run(x, *copies4[next(calls) % len(copies4)], config=c), a.iters, a.repeat)
                line += (f"; {'rule ' if c == rule else ''}{tuple(c)} {us:7.1f} ({100 * floor / us:3.0f}% of "
                         f"floor, {bf16 / us:4.2f}x bf16, diff {diff:.0e})")
                if c == rule:
                    total.setdefault(m, [0.0, 0.0])
                    total[m][0] += us
                    total[m][1] += bf16
            print(line, flush=True)
    for m, (w4, bf16) in total.items():
        print(f"one layer's projections, m={m}: W4A16 {w4:.1f} us, bf16 {bf16:.1f} us ({bf16 / w4:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
