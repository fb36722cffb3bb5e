#!/usr/bin/env python
"""The CPU's small-batch projection kernels against torch's matmul, on a model's projection shapes: the time of one
decode step's projections (every layer's qkv, o, gate_up and down, and the LM head), weights cold in memory as in a
step, for each row count: float32 weights (minisrv/kernels/cpu_gemv.c; it sets kernels/cpu_gemv.py's MAX_ROWS) and
weights kept in GGUF blocks (cpu_blocks.c, random 4-bit values: the bytes a Q4_1 model's step reads).

  python scripts/bench_cpu_gemv.py [--rows 1,2,4,8,16,32,48,64] [--layers 30]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import List, Tuple

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# SmolLM2-135M (the default model): hidden 576, 9 + 2 x 3 heads of 64, MLP 1536, vocabulary 49,152
DEFAULT_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
DEFAULT_HEAD = (49152, 576)


def step_time(project, weights: List[list], xs: dict, reps: int) -> float:
    """Median ms of one pass over every weight (each layer's own tensors, so they come from memory); a weight is a
    tensor or (packed blocks, its shape)."""
    def one() -> None:
        for group in weights:
            for w in group:
                project(xs[w.shape[1] if torch.is_tensor(w) else w[1][1]], w)
    one()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        one()
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2] * 1000


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,2,4,8,16,32,48,64")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--reps", type=int, default=7)
    a = p.parse_args()
    from minisrv.kernels.cpu_gemv import SmallBatchLinear
    small, how = SmallBatchLinear.load()
    if small is None:
        print(f"the kernel does not build here: {how}")
        return 1
    torch.manual_seed(0)
    shapes: List[Tuple[int, int]] = DEFAULT_SHAPES
    weights = [[torch.randn(*s) for _ in range(a.layers)] for s in shapes] + [[torch.randn(*DEFAULT_HEAD)]]
    print(f"{how}; {torch.get_num_threads()} threads, CPU capability {torch.backends.cpu.get_cpu_capability()}")
    from minisrv.kernels.cpu_blocks import BlockKernels
    from minisrv.models.gguf_blocks import packed_shape
    blocks, _ = BlockKernels.load()

    def random_records(n: int, k: int) -> torch.Tensor:
        """Records of random 4-bit values with small scales and offsets (d[4], m[4] float32, then the bytes)."""
        rec = torch.randint(0, 16, packed_shape(n, k), dtype=torch.uint8)
        dm = torch.cat([torch.rand(*rec.shape[:2], 4) * 0.01, -torch.rand(*rec.shape[:2], 4) * 0.05], dim=-1)
        rec[..., :32] = dm.contiguous().view(torch.uint8).view(*rec.shape[:2], 32)
        return rec

    packed = [[(random_records(*w.shape), w.shape) for w in group] for group in weights] \
        if blocks is not None else None

    def blocks_step(x, w):
        (p_, (n, k)) = w
        return blocks.matmul(x, p_, n, k)

    print("| rows | torch matmul ms | float32 kernel ms | blocks kernel ms |\n| ---: | ---: | ---: | ---: |")
    with torch.no_grad():
        for m in (int(r) for r in a.rows.split(",")):
            xs = {k: torch.randn(m, k) for k in {s[1] for s in shapes} | {DEFAULT_HEAD[1]}}
            t_torch = step_time(lambda x, w: F.linear(x, w), weights, xs, a.reps)
            t_kernel = step_time(lambda x, w: small(x, w), weights, xs, a.reps)
            t_blocks = step_time(blocks_step, packed, xs, a.reps) if packed is not None else float("nan")
            print(f"| {m} | {t_torch:.1f} | {t_kernel:.1f} | {t_blocks:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
