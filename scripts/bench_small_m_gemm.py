#!/usr/bin/env python
"""The decode GEMM alone: the small-batch Triton kernel (minisrv/models/small_m_gemm.py) over a sweep of its launch
parameters, against cuBLAS on the same operands and the bytes it must read (the weights once).

Kinds (--kinds): fp8 (W8A8, against cuBLAS's row-wise FP8 GEMM `torch._scaled_mm`), bf16 (against F.linear).
Shapes are a Llama-3-8B layer's projections ([N, K]: qkv 6144 x 4096, o 4096 x 4096, gate_up 28672 x 4096, down
4096 x 14336; with --tp 2 a rank's halves; --shapes for others) at decode batch sizes (--ms). Each configuration
runs --iters times in a CUDA graph; the median of --repeat replays is reported, with the best configuration per
shape and batch size, the one in use (`config_for`), and the best one's relative difference from cuBLAS. The calls
cycle through copies of the weights that together exceed the GPU's L2 cache (--cycle-bytes), as a model's layers
do: a 4096 x 2048 bf16 weight (16 MiB) would otherwise be read from the 50 MiB L2 after its first call.
--gemv-block-n adds the one-row kernel's configurations (SmallMConfig.gemv) at m = 1. --silu-mul sweeps the gate and
up projections (gate_up, or --shapes) as the model runs them at m = 1: the one-row kernel ending in SiLU-and-mul
(run(..., silu_mul=True); block_n counts weight rows, gate and up) against cuBLAS followed by the activation kernel
(FlashInfer's where installed, as the layers use); a recorded winner is that shape's one-row entry.

  python scripts/bench_small_m_gemm.py [--kinds fp8,bf16] [--tp 1] [--ms 1,16,64] [--shapes 6144x4096]
                                      [--write-configs]

--chain times a layer's four projections at m = 1 one after another, as a decode step runs them (the in-use
configurations, gate_up ending in SiLU-and-mul where it can), cycling weight copies past L2: cuBLAS (and the
activation), the one-row kernel, and the one-row kernel as programmatic dependent launches (SM 90+): every
product, or only the down projection after a one-row gate_up (as the layers launch them).

--write-configs records each shape and batch size's best configuration in this GPU model's table
(minisrv/models/small_m_configs/, read by `small_m_gemm.config_for`) where it beats the configuration in use by
more than --min-gain (the table's entry, else `default_config`'s).
"""
from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from graph_timing import add_timing_args, graph_us  # noqa: E402 (beside this script)

from minisrv.models.fp8 import quantize_rows  # noqa: E402
from minisrv.models.layers import fused_ops_for, silu_and_mul  # noqa: E402
from minisrv.models.small_m_gemm import (TUNED_M, SmallMConfig, config_file, config_for, small_m_gemm,  # noqa: E402
                                         takes_silu_mul, tuned_key)


def llama_8b_shapes(tp: int) -> str:
    """qkv, o, gate_up, down of Llama-3-8B on one of `tp` ranks (column-parallel N and row-parallel K split)."""
    return f"{6144 // tp}x4096,4096x{4096 // tp},{28672 // tp}x4096,4096x{14336 // tp}"


def silu_and_mul_kernel():
    """The activation the layers run after a separate gate and up product (layers.silu_and_mul with their fused
    ops: FlashInfer's where installed, else torch's)."""
    return functools.partial(silu_and_mul, fused=fused_ops_for(torch.device("cuda")))


def record(gpu: str, key: str, config: SmallMConfig) -> None:
    """Put one winner into this GPU model's table (small_m_configs/), one entry a line:
    "kind NxK m": [block_n, block_k, num_warps, num_stages(, split_k(, gemv))], trailing defaults left out."""
    path = config_file(gpu)
    table = {}
    if os.path.exists(path):
        with open(path) as f:
            table = json.load(f)
    entry = list(config[:4]) + ([config.split_k] if config.split_k != 1 or config.gemv else []) + (
        [True] if config.gemv else [])
    table[key] = entry
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write("{\n" + ",\n".join(f" {json.dumps(k)}: {json.dumps(table[k])}" for k in sorted(table)) + "\n}\n")
    print(f"  recorded {key}: {entry} in {path}", flush=True)


def cycling(product, weights):
    """A no-argument call of product(w) that takes the next of `weights` each time it is called."""
    calls = itertools.count()
    return lambda: product(weights[next(calls) % len(weights)])


def time_chain(a, run, gpu: str) -> None:
    """--chain: a layer's projections in a row, cuBLAS against the one-row kernel launched three ways."""
    shapes = [tuple(int(x) for x in shape.split("x")) for shape in (a.shapes or llama_8b_shapes(a.tp)).split(",")]
    act = silu_and_mul_kernel()
    steps = []  # (n, k, config, silu_mul, weight copies, x)
    for i, (n, k) in enumerate(shapes):
        w = (torch.randn(n, k, device="cuda") * 0.02).bfloat16()
        copies = [w] + [w.clone() for _ in range(max(1, -(-int(a.cycle_bytes) // (n * k * 2))) - 1)]
        config = config_for("bf16", n, k, 1, gpu)
        gated = i == 2 and takes_silu_mul(config, "bf16", 1, n)  # Llama's third projection is gate_up
        steps.append((n, k, config, gated, copies, torch.randn(1, k, device="cuda").bfloat16()))
    calls = itertools.count()

    def chain(mode: str) -> None:
        c = next(calls)
        for i, (n, k, config, gated, copies, x) in enumerate(steps):
            w = copies[c % len(copies)]
            if mode == "cublas" or not config.gemv:
                y = F.linear(x, w)
                if i == 2:
                    act(y)
            else:
                # "pdl": every product a dependent launch, "pdl-down": only the one after a one-row product
                pdl = mode == "pdl" or (mode == "pdl-down" and i == 3 and steps[2][2].gemv)
                run(x, w, config=config, raise_errors=True, silu_mul=gated, gdc=mode != "gemv", dependent_launch=pdl)
                if i == 2 and not gated:
                    act(F.linear(x, w))
    floor = sum(n * k * 2 for n, k in shapes) / a.bandwidth * 1e6
    print(f"chain {' '.join(f'{n}x{k}' for n, k in shapes)} (floor {floor:.1f} us); configs "
          + ", ".join(f"{tuple(s[2])}{' silu' if s[3] else ''}" for s in steps))
    for mode in ("cublas", "gemv", "pdl", "pdl-down"):
        us = graph_us(lambda: chain(mode), a.iters, a.repeat)
        print(f"  {mode:>12}: {us:6.1f} us ({100 * floor / us:3.0f}% of the floor)", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kinds", default="fp8,bf16")
    p.add_argument("--tp", type=int, default=1, help="the default shapes are one of this many ranks'")
    p.add_argument("--shapes", default=None, help="NxK weight shapes, comma-separated (default: Llama-3-8B's)")
    p.add_argument("--ms", default="1,16,64", help="rows (decode batch sizes)")
    p.add_argument("--block-n", default="16,32,64,128", help="the dot kernel's column blocks ('': only the one "
                   "in use, e.g. to sweep the one-row kernel alone)")
    p.add_argument("--block-k", default="64,128,256", help="fp8 kinds skip 64")
    p.add_argument("--num-warps", default="2,4,8")
    p.add_argument("--num-stages", default="3,4,5")
    p.add_argument("--split-k", default="1", help="programs per column block, each over a slice of K (e.g. 1,2,4)")
    p.add_argument("--gemv-block-n", default="", help="the one-row kernel's column blocks at m = 1 (e.g. 4,8,16)")
    p.add_argument("--gemv-block-k", default="256,512,1024")
    p.add_argument("--silu-mul", action="store_true", help="gate and up projections ending in SiLU-and-mul, m = 1")
    p.add_argument("--chain", action="store_true", help="a layer's projections in a row (see above)")
    p.add_argument("--cycle-bytes", type=float, default=256e6, help="weight copies cycled through, in bytes at least")
    p.add_argument("--write-configs", action="store_true", help="record the winners in this GPU's table")
    p.add_argument("--min-gain", type=float, default=0.02, help="--write-configs: the least relative gain recorded")
    add_timing_args(p, repeat=10)
    a = p.parse_args()
    ints = lambda text: [int(x) for x in text.split(",")]  # noqa: E731
    run = small_m_gemm()
    if run is None:
        print("Triton is missing: nothing to sweep")
        return 1
    configs = [SmallMConfig(*c) for c in itertools.product(ints(a.block_n), ints(a.block_k), ints(a.num_warps),
                                                           ints(a.num_stages), ints(a.split_k))] if a.block_n else []
    gemv_configs = [SmallMConfig(*c, gemv=True) for c in itertools.product(
        ints(a.gemv_block_n), ints(a.gemv_block_k), ints(a.num_warps), ints(a.num_stages), ints(a.split_k))] \
        if a.gemv_block_n else []
    torch.manual_seed(0)
    gpu = torch.cuda.get_device_name()
    if a.chain:
        time_chain(a, run, gpu)
        return 0
    act = silu_and_mul_kernel()
    if a.silu_mul:  # only what can end in the activation: one-row configurations at m = 1 over the gate_up shapes
        configs, a.ms, a.kinds = [], "1", "bf16"
        gemv_configs = [c for c in gemv_configs if takes_silu_mul(c, "bf16", 1, 2)]
        a.shapes = a.shapes or llama_8b_shapes(a.tp).split(",")[2]
    print(f"{gpu}; us per GEMM (median of {a.repeat} x {a.iters}), % of "
          f"{a.bandwidth / 1e12:.2f} TB/s over the weight bytes")
    for kind in a.kinds.split(","):
        wbytes = 2 if kind == "bf16" else 1
        for shape in (a.shapes or llama_8b_shapes(a.tp)).split(","):
            n, k = (int(x) for x in shape.split("x"))
            w = (torch.randn(n, k, device="cuda") * 0.02).bfloat16()
            wq, ws = quantize_rows(w)
            ws = ws.reshape(1, -1).contiguous()
            floor = n * k * wbytes / a.bandwidth * 1e6
            copies = max(1, -(-int(a.cycle_bytes) // (n * k * wbytes)))
            copies_of_w = [w] + [w.clone() for _ in range(copies - 1)] if kind == "bf16" else [wq] + [
                wq.clone() for _ in range(copies - 1)]
            for m in ints(a.ms):
                x = torch.randn(m, k, device="cuda").bfloat16()
                xq, xs = quantize_rows(x)
                if kind == "fp8":
                    ours = lambda c, wq=wq, xq=xq, xs=xs: run(  # noqa: E731
                        xq, wq, xs=xs, ws=ws, config=c, raise_errors=True)
                    theirs = lambda wq=wq, xq=xq, xs=xs: torch._scaled_mm(  # noqa: E731
                        xq, wq.t(), scale_a=xs, scale_b=ws, out_dtype=torch.bfloat16)
                elif a.silu_mul:
                    ours = lambda c, w=w, x=x: run(x, w, config=c, raise_errors=True, silu_mul=True)  # noqa: E731
                    theirs = lambda w=w, x=x: act(F.linear(x, w))  # noqa: E731
                else:
                    ours = lambda c, w=w, x=x: run(x, w, config=c, raise_errors=True)  # noqa: E731
                    theirs = lambda w=w, x=x: F.linear(x, w)  # noqa: E731
                ref = theirs()
                cublas = graph_us(cycling(theirs, copies_of_w), a.iters, a.repeat)
                default = config_for(kind, n, k, m, gpu)  # what the layers run now
                results = {}

                def relative_diff(out: torch.Tensor, ref: torch.Tensor = ref) -> float:
                    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()

                def wrong(out: torch.Tensor) -> bool:
                    return relative_diff(out) > 1e-2
                in_use = {default} if not a.silu_mul or takes_silu_mul(default, kind, m, n) else set()
                for c in set(configs) | set(gemv_configs if m == 1 else []) | in_use:
                    if k % (c.block_k * c.split_k) or (wbytes == 1 and c.block_k < 128):
                        continue
                    try:
                        if wrong(ours(c)):
                            raise AssertionError("differs from cuBLAS")
                        results[c] = graph_us(cycling(lambda w, c=c: ours(c, w), copies_of_w), a.iters, a.repeat)
                        if wrong(ours(c)):  # after many replays: a split-K race would show
                            raise AssertionError("differs from cuBLAS after the timing")
                    except Exception as e:  # noqa: BLE001 - e.g. more shared memory than the GPU has
                        results.pop(c, None)
                        print(f"  {kind} {shape} m={m} {tuple(c)}: {type(e).__name__} {e}")
                best = min(results, key=results.get)
                diff = relative_diff(ours(best))
                pct = lambda us: f"{us:6.1f} us ({100 * floor / us:3.0f}%)"  # noqa: E731
                print(f"{kind:>5} {shape:>11} m={m:3d}: floor {floor:6.1f} us; cuBLAS {pct(cublas)}; "
                      f"in use {tuple(default)} {pct(results.get(default, float('nan')))}; "
                      f"best {tuple(best)} {pct(results[best])} (from cuBLAS {diff:.1e}); next: "
                      + ", ".join(f"{tuple(c)} {results[c]:.1f}" for c in sorted(results, key=results.get)[1:4]),
                      flush=True)
                # the silu-mul sweep's alternative is cuBLAS and the activation, unless a one-row entry is in use
                beat = results.get(default, 1e9) if in_use or not a.silu_mul else cublas
                if a.write_configs and m in TUNED_M and results[best] < (1 - a.min_gain) * beat:
                    record(gpu, tuned_key(kind, n, k, m), best)  # at once: a sweep cut off keeps what it found
    return 0


if __name__ == "__main__":
    sys.exit(main())
