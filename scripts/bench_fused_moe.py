#!/usr/bin/env python
"""The fused experts (minisrv/kernels/fused_moe.py) on a GPU, at a model's MoE shape (default Qwen3-30B-A3B's layer:
hidden 2048, moe_intermediate 768, 128 experts, top-8), against the time their weight bytes take to read.

For each token count: the fused path's time per call (route excluded; CUDA events, median of --repeat replays of a CUDA
graph holding --iters calls, each call with its own routing so that the experts hit change as between layers), the
router top-k's and the alignment kernel's times (and their torch ops'), the expert weight bytes a call touches (distinct
experts hit x an expert's bytes, averaged over the calls) and the share of --bandwidth that reaches, and
experts_reference's time (eager: it syncs with the host). --configs times other launch configurations beside the rule's
(block_m,block_n,block_k,num_warps,num_stages;...), to check or refine config_for. --int4 G: 4-bit experts in groups of
G rows (0: one per channel; random words, kernels/moe_w4a16.py's layout), their bytes (and their scales' and zeros') the
floor's. --mxfp4 with --pair-configs: a decode step's pairs' two GEMVs (kernels/mxfp4_pairs.py) at other launch
parameters (block_n,block_k,num_warps;...), beside the default's.

  python scripts/bench_fused_moe.py [--tokens 1,64,256,2048] [--experts 128 --top-k 8 --hidden 2048 --inter 768]
                                    [--fp8 | --int4 128 | --mxfp4] [--configs 16,32,128,4,4] [--align]
"""
from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from graph_timing import add_timing_args, graph_us  # noqa: E402 (beside this script)

from minisrv.kernels.fp8_quant import quantize_rows, quantize_tokens  # noqa: E402
from minisrv.kernels.fused_moe import (PAIR_ROWS, experts_reference, route, route_and_align,  # noqa: E402
                                       route_reference, triton_experts)
from minisrv.kernels.moe_align import align_reference, triton_align  # noqa: E402
from minisrv.kernels.moe_route import ROUTER_TOKENS  # noqa: E402
from minisrv.kernels.moe_gemm import ClampedSwiGLU, MoeConfig, config_for, moe_gemm  # noqa: E402
from minisrv.kernels.moe_w4a16 import Mxfp4Experts, PackedExperts  # noqa: E402
from minisrv.kernels.mxfp4_pairs import PairConfig, mxfp4_pair_gemv  # noqa: E402


def eager_us(fn, repeat: int) -> float:
    """Median microseconds of `fn` run eagerly (after one warm-up), each call timed by CUDA events."""
    fn()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def pair_gemvs(x, w13, w2, ids, top_k: int, a) -> str:
    """The pairs' two GEMVs alone as a decode step runs them (gate/up with gpt-oss's activation, down with the
    routing weights) at the default and --pair-configs, each with its largest difference from the default's outputs
    (the sums in another order: float32 rounding)."""
    gemv = mxfp4_pair_gemv()
    flat = ids.reshape(-1).to(torch.int32).contiguous()
    act = torch.randn(flat.numel(), w2.blocks.shape[2] * 2, device="cuda").bfloat16()
    weights = torch.rand(flat.numel(), device="cuda")
    swiglu = ClampedSwiGLU(1.702, 7.0)

    def both(c):
        return (gemv(x, w13.blocks, w13.scales, flat, top_k, config=c, gated=True, swiglu=swiglu),
                gemv(act, w2.blocks, w2.scales, flat, 1, config=c, row_weights=weights))
    ref = both(PairConfig())
    out = ""
    for c in [PairConfig()] + [PairConfig(*(int(v) for v in c.split(","))) for c in a.pair_configs.split(";") if c]:
        diff = max((g.float() - r.float()).abs().max().item() / r.float().abs().max().item()
                   for g, r in zip(both(c), ref))
        out += f"; pairs {tuple(c)} {graph_us(lambda: both(c), a.iters, a.repeat):7.1f} us (diff {diff:.0e})"
    return out


def products_us(x, w13, w2, s13, s2, routing, c: MoeConfig, a) -> tuple:
    """Microseconds of the gate/up product and of the down product alone (one routing, operands ready), with
    launch configuration c: to choose each product's configuration (their shares of the floor: 2/3 and 1/3)."""
    weights, ids = routing
    t, k = ids.shape
    int4 = isinstance(w13, (PackedExperts, Mxfp4Experts))  # (both layouts name their sizes)
    aligned = triton_align()(ids, w13.num_experts if int4 else w13.shape[0], c.block_m)
    gemm = moe_gemm()
    a1, a1s = quantize_tokens(x) if s13 is not None else (x, None)
    act = torch.empty(t * k, w2.k if int4 else w2.shape[2], dtype=x.dtype, device=x.device)
    gemm(a1, a1s, w13, s13, act, None, aligned, k, True, c)
    a2, a2s = quantize_tokens(act) if s13 is not None else (act, None)
    out = torch.empty(t * k, x.shape[1], dtype=x.dtype, device=x.device)
    flat = weights.reshape(-1).contiguous()
    return (graph_us(lambda: gemm(a1, a1s, w13, s13, act, None, aligned, k, True, c), a.iters, a.repeat),
            graph_us(lambda: gemm(a2, a2s, w2, s2, out, flat, aligned, 1, False, c), a.iters, a.repeat))


def random_int4(e: int, k: int, n: int, group: int) -> PackedExperts:
    """E random 4-bit [k, n] weights (random words: every nibble a value) with scales of a unit-variance product."""
    groups = k // (group or k)
    qweight = torch.randint(-2 ** 31, 2 ** 31 - 1, (e, k // 8, n), dtype=torch.int32, device="cuda")
    scales = torch.full((e, groups, n), 0.3 * k ** -0.5, dtype=torch.float16, device="cuda")
    zeros = torch.full((e, groups, n), 8, dtype=torch.uint8, device="cuda")
    return PackedExperts(qweight, scales, zeros)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="1,64,256,2048", help="token counts, comma-separated")
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--inter", type=int, default=768, help="each expert's intermediate width")
    p.add_argument("--fp8", action="store_true", help="FP8 (W8A8) expert weights")
    p.add_argument("--int4", type=int, default=None, metavar="GROUP",
                   help="4-bit (W4A16) expert weights in groups of GROUP rows (0: per channel)")
    p.add_argument("--mxfp4", action="store_true",
                   help="MXFP4 experts (gpt-oss: e.g. --experts 32 --top-k 4 --hidden 2880 --inter 2880); up to "
                        "PAIR_ROWS pairs also timed on the grouped GEMM")
    p.add_argument("--configs", default="", help="more launch configurations to time, ';'-separated")
    p.add_argument("--pair-configs", default="", help="MXFP4 pairs' GEMV launch parameters to time, ';'-separated")
    p.add_argument("--routings", type=int, default=8, help="distinct routings cycled through")
    p.add_argument("--no-reference", action="store_true", help="skip timing experts_reference")
    p.add_argument("--products", action="store_true",
                   help="time the gate/up and the down product alone for each configuration, not the whole call")
    add_timing_args(p, repeat=20)
    p.add_argument("--align", action="store_true",
                   help="time only the alignment, in one launch and in three (to choose ONE_LAUNCH_PAIRS)")
    a = p.parse_args()
    e, k, h, inter = a.experts, a.top_k, a.hidden, a.inter
    torch.manual_seed(0)
    w13 = (torch.randn(e, 2 * inter, h, device="cuda") * h ** -0.5).bfloat16()
    w2 = (torch.randn(e, h, inter, device="cuda") * inter ** -0.5).bfloat16()
    s13 = s2 = None
    if a.fp8:
        q13, s13 = quantize_rows(w13.reshape(-1, h))
        q2, s2 = quantize_rows(w2.reshape(-1, inter))
        w13, w2, s13, s2 = q13.view(e, 2 * inter, h), q2.view(e, h, inter), s13.view(e, -1), s2.view(e, -1)
    expert_bytes = 3 * h * inter * w13.element_size()
    kind = "FP8" if a.fp8 else "bf16"
    if a.int4 is not None:
        w13, w2 = random_int4(e, h, 2 * inter, a.int4), random_int4(e, inter, h, a.int4)
        expert_bytes = sum(t[0].numel() * t.element_size() for w in (w13, w2) for t in w[:3])  # one expert
        kind = f"4-bit, groups of {a.int4 or 'K'}"
    if a.mxfp4:
        w13, w2 = (Mxfp4Experts(torch.randint(0, 256, (e, n, kk // 2), dtype=torch.uint8, device="cuda"),
                                torch.randint(121, 125, (e, n, kk // 32), dtype=torch.uint8, device="cuda"))
                   for n, kk in ((2 * inter, h), (h, inter)))
        expert_bytes = sum(t[0].numel() for w in (w13, w2) for t in w)  # one expert's bytes and exponents
        kind = "MXFP4"
    extra = [MoeConfig(*(int(v) for v in c.split(","))) for c in a.configs.split(";") if c]
    align = triton_align()
    print(f"{torch.cuda.get_device_name()}; E={e} top-{k} H={h} I={inter} {kind}; us per "
          f"call (median of {a.repeat} x {a.iters}), % of {a.bandwidth / 1e12:.2f} TB/s over the expert bytes hit")
    for t in (int(v) for v in a.tokens.split(",")):
        x = torch.randn(t, h, device="cuda").bfloat16()
        routings = [route(torch.randn(t, e, device="cuda"), k, True) for _ in range(a.routings)]
        hit = sum(int(ids.unique().numel()) for _, ids in routings) / len(routings)
        floor = hit * expert_bytes / a.bandwidth * 1e6
        rule = config_for(t * k, e, a.fp8, a.mxfp4)
        if a.align:
            ids = routings[0][1]
            print(f"T={t:5d} ({t * k} pairs, {rule.block_m}-row blocks): align one launch "
                  f"{graph_us(lambda: align(ids, e, rule.block_m, True), a.iters, a.repeat):5.1f} us, three launches "
                  f"{graph_us(lambda: align(ids, e, rule.block_m, False), a.iters, a.repeat):5.1f} us", flush=True)
            continue
        line = f"T={t:5d}: {hit:5.1f} experts hit, {hit * expert_bytes / 1e6:7.1f} MB, floor {floor:7.1f} us"
        if a.products:
            for c in [rule] + [c for c in extra if c != rule]:
                gate_up, down = products_us(x, w13, w2, s13, s2, routings[0], c, a)
                print(f"T={t:5d} {'rule ' if c == rule else '     '}{tuple(c)}: gate/up {gate_up:7.1f} us "
                      f"({100 * floor * 2 / 3 / gate_up:3.0f}%), down {down:7.1f} us ({100 * floor / 3 / down:3.0f}%)",
                      flush=True)
            continue
        for c in [rule] + [c for c in extra if c != rule]:
            calls = itertools.count()

            def fused(c=c):
                w, ids = routings[next(calls) % len(routings)]
                return triton_experts(x, w13, w2, w, ids, s13, s2, config=None if c == rule else c)
            us = graph_us(fused, a.iters, a.repeat)
            line += f"; {'rule ' if c == rule else ''}{tuple(c)} {us:7.1f} us ({100 * floor / us:3.0f}%)"
        if a.mxfp4 and t * k <= PAIR_ROWS:  # the pairs' own kernel above; here the grouped GEMM on them
            w, ids = routings[0]
            us = graph_us(lambda: triton_experts(x, w13, w2, w, ids, config=rule), a.iters, a.repeat)
            line += f"; grouped GEMM {us:7.1f} us ({100 * floor / us:3.0f}%)"
            line += pair_gemvs(x, w13, w2, ids, k, a)
        logits = torch.randn(t, e, device="cuda").bfloat16()
        line += f"; route {graph_us(lambda: route(logits, k, True), a.iters, a.repeat):5.1f} us"
        line += f" (torch {graph_us(lambda: route_reference(logits, k, True), a.iters, a.repeat):5.1f})"
        ids = routings[0][1]
        line += f"; align {graph_us(lambda: align(ids, e, rule.block_m), a.iters, a.repeat):5.1f} us"
        if t <= ROUTER_TOKENS:  # the router's product, top-k and alignment: one launch against three
            wr = torch.randn(e, h, device="cuda").bfloat16()
            counter = torch.zeros(1, dtype=torch.int32, device="cuda")
            one = graph_us(lambda: route_and_align(x, wr, counter, k, True, w13, a.fp8), a.iters, a.repeat)
            three = graph_us(lambda: align(route(x @ wr.t(), k, True)[1], e, rule.block_m), a.iters, a.repeat)
            line += f"; router + route + align one launch {one:5.1f} us (cuBLAS + two {three:5.1f})"
        line += f" (torch {graph_us(lambda: align_reference(ids, e, rule.block_m), a.iters, a.repeat):5.1f})"
        if not a.no_reference:
            w, ids = routings[0]
            ref = eager_us(lambda: experts_reference(x, w13, w2, w, ids, s13, s2), max(3, a.repeat // 4))
            line += f"; experts_reference {ref:8.1f} us"
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
