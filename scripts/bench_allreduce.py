"""What follows a row-parallel projection at decode on N GPUs, [rows, hidden] bf16: NCCL's all-reduce then
FlashInfer's residual add + RMSNorm (two kernels), against the fused all-reduce + add + norm
(--enable-flashinfer-allreduce-fusion: FlashInfer's allreduce_fusion as minisrv calls it, then forced one-shot,
forced two-shot, and with float32 accumulation), each checked against the two-kernel result. Each is timed as a
CUDA graph of 20 back-to-back calls (as a decode step replays them), median of 20 replays.

    python scripts/bench_allreduce.py [--tp-size 2] [--hidden 4096] [--rows 1,16,64]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from minisrv.distributed import NO_MULTICAST_ENV, Rendezvous, TensorParallel, init_tensor_parallel  # noqa: E402
from minisrv.engine.tp_workers import free_tcp_address  # noqa: E402

CALLS = 20


def _time_graph(fn, x: torch.Tensor) -> float:
    """Median milliseconds of one all-reduce, from replays of a graph of CALLS of them."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn(x)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = x
        for _ in range(CALLS):
            y = fn(y) * 0.5  # a dependent chain, as layers are
    times = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / CALLS)
    return statistics.median(times)


def fused_rows(tp: TensorParallel, nccl: TensorParallel, device: torch.device, hidden: int, rows_list):
    """--fused: (rows, {variant: ms per call}, {variant: results agree with NCCL + norm}) for each row count."""
    import flashinfer
    fused = tp.fused_norm
    comm, eps = fused.comm, 1e-5
    weight = torch.rand(hidden, device=device, dtype=torch.bfloat16) + 0.5
    out = []
    for rows in rows_list:
        residual = torch.randn(rows, hidden, device=device, dtype=torch.bfloat16)
        running = residual.clone()  # the two-kernel path adds into its residual in place

        def two_kernels(y):
            y = nccl.all_reduce(y)
            flashinfer.norm.fused_add_rmsnorm(y, running, weight, eps)
            return y

        def fused_with(**options):
            def call(y):
                norm_out, residual_out = torch.empty_like(y), torch.empty_like(residual)
                comm.allreduce_fusion(input=y, workspace=fused.workspace, pattern=fused.pattern,
                                      residual_out=residual_out, norm_out=norm_out, residual_in=residual,
                                      rms_gamma=weight, rms_eps=eps, **options)
                return norm_out
            return call
        variants = {"nccl + norm": two_kernels, "fused": lambda y: fused(y, residual, weight, eps)[0],
                    "fused one-shot": fused_with(use_oneshot=True), "fused two-shot": fused_with(use_oneshot=False),
                    "fused fp32 acc": fused_with(fp32_acc=True)}
        x = torch.randn(rows, hidden, device=device, dtype=torch.bfloat16) / 64
        ref = two_kernels(x.clone()).float()
        running.copy_(residual)
        times, same = {}, {}
        for name, fn in variants.items():
            try:
                same[name] = torch.allclose(fn(x.clone()).float(), ref, rtol=2e-2, atol=2e-2)
                running.copy_(residual)
                times[name] = _time_graph(fn, x.clone())
            except Exception as e:  # noqa: BLE001 - e.g. a strategy the kernel refuses for this size
                times[name], same[name] = float("nan"), f"{type(e).__name__}: {e}"[:80]
        out.append((rows, times, same))
    return out


def worker(rank: int, size: int, addr: str, queue, hidden: int, rows_list) -> None:
    os.environ.update(NO_MULTICAST_ENV)
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    tp = init_tensor_parallel(rank, size, Rendezvous(addr, 0), device,  # fresh processes
                              fused_norm=(hidden, torch.bfloat16))
    nccl = TensorParallel(tp.rank, tp.size, tp.group, tp.control)  # the same group, NCCL and a separate norm
    result = fused_rows(tp, nccl, device, hidden, rows_list)
    if rank == 0:
        queue.put(result)
    import torch.distributed as dist
    dist.barrier(group=tp.control)
    tp.fused_norm.close()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tp-size", type=int, default=2)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--rows", default="1,16,64")
    a = p.parse_args()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    addr = free_tcp_address()
    procs = [ctx.Process(target=worker, args=(r, a.tp_size, addr, queue, a.hidden, [int(x) for x in a.rows.split(",")]))
             for r in range(a.tp_size)]
    for pr in procs:
        pr.start()
    rows = queue.get(timeout=300)
    for pr in procs:
        pr.join(60)
    print(f"all-reduce + residual add + RMSNorm of [rows, {a.hidden}] bf16 on {a.tp_size} GPUs "
          f"({torch.cuda.get_device_name(0)}), us per call in a CUDA graph")
    for n, times, same in rows:
        print(f"{n:4d} rows: " + "; ".join(
            f"{name} {times[name] * 1e3:.1f}" + ("" if same[name] is True else f" ({same[name] or 'DIFFERS'})")
            for name in times))


if __name__ == "__main__":
    main()
