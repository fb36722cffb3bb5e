"""Timing of short GPU work for the kernel benchmarks (bench_attention.py, bench_small_m_gemm.py): the call captured
many times in one CUDA graph, so launch overhead does not count, and the median over graph replays."""
from __future__ import annotations

import argparse
import statistics

import torch


def add_timing_args(p: argparse.ArgumentParser, repeat: int) -> None:
    """--iters and --repeat (graph_us's), and --bandwidth for the floor each figure is set against."""
    p.add_argument("--iters", type=int, default=20, help="calls captured in one CUDA graph")
    p.add_argument("--repeat", type=int, default=repeat, help="graph replays; the median is reported")
    p.add_argument("--bandwidth", type=float, default=3.35e12, help="bytes/s (H100 SXM HBM3)")


def graph_us(fn, iters: int, repeat: int) -> float:
    """Median microseconds per call of `fn` (no arguments), captured `iters` times in one CUDA graph and replayed
    `repeat` times. `fn` runs once before capture (lazy compilation and allocation happen there)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(iters):
                fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / iters)
    return statistics.median(times)
