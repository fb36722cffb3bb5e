"""All-reduce time by message size on N GPUs: NCCL against the one-shot path (minisrv.distributed.OneShotAllReduce),
each as a CUDA graph of 20 back-to-back all-reduces (as a decode step replays them), median of 20 replays.

    python scripts/bench_allreduce.py [--tp-size 2] [--sizes-kib 8,32,128,512,1024,4096]
    python scripts/bench_allreduce.py --fused [--hidden 4096] [--rows 1,16,64]

Used to choose ONE_SHOT_MAX_BYTES: the one-shot path should win every size below it.

--fused times what follows a row-parallel projection at decode, [rows, hidden] bf16: NCCL's all-reduce then
FlashInfer's residual add + RMSNorm (two kernels), against the fused all-reduce + add + norm
(--enable-flashinfer-allreduce-fusion: FlashInfer's allreduce_fusion as minisrv calls it, then forced one-shot,
forced two-shot, and with float32 accumulation), each checked against the two-kernel result.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from minisrv.distributed import (NO_MULTICAST_ENV, OneShotAllReduce, Rendezvous, TensorParallel,  # noqa: E402
                                 init_tensor_parallel)
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


def worker(rank: int, size: int, addr: str, sizes_kib, queue, fused_args=None) -> None:
    os.environ.update(NO_MULTICAST_ENV)
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    tp = init_tensor_parallel(rank, size, Rendezvous(addr, 0), device, torch.bfloat16,  # fresh processes
                              fused_norm=(fused_args[0], torch.bfloat16) if fused_args else None)
    nccl = TensorParallel(tp.rank, tp.size, tp.group, tp.control)  # the same group, NCCL for every size
    if fused_args:
        result = fused_rows(tp, nccl, device, *fused_args)
        if rank == 0:
            queue.put(result)
        import torch.distributed as dist
        dist.barrier(group=tp.control)
        tp.fused_norm.close()
        dist.destroy_process_group()
        return
    rows = []
    for kib in sizes_kib:
        n = kib * 1024 // 2
        x = torch.randn(n, device=device, dtype=torch.bfloat16) / 64
        one = OneShotAllReduce(tp.group, device, torch.bfloat16, n * 2) if tp.one_shot is not None else None
        t_nccl = _time_graph(nccl.all_reduce, x.clone())
        t_one = _time_graph(one, x.clone()) if one is not None else float("nan")
        ref = nccl.all_reduce(x.clone())
        same = one is None or torch.allclose(one(x.clone()).float(), ref.float(), rtol=1e-2, atol=1e-2)
        rows.append((kib, t_nccl, t_one, same))
    if rank == 0:
        queue.put(rows)
    import torch.distributed as dist
    dist.barrier(group=tp.control)
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tp-size", type=int, default=2)
    p.add_argument("--sizes-kib", default="8,32,128,256,512,1024,2048,4096")
    p.add_argument("--fused", action="store_true", help="the fused all-reduce + add + RMSNorm (see above)")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--rows", default="1,16,64")
    a = p.parse_args()
    sizes = [int(s) for s in a.sizes_kib.split(",")]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    addr = free_tcp_address()
    fused_args = (a.hidden, [int(r) for r in a.rows.split(",")]) if a.fused else None
    procs = [ctx.Process(target=worker, args=(r, a.tp_size, addr, sizes, queue, fused_args))
             for r in range(a.tp_size)]
    for pr in procs:
        pr.start()
    rows = queue.get(timeout=300)
    for pr in procs:
        pr.join(60)
    if a.fused:
        print(f"all-reduce + residual add + RMSNorm of [rows, {a.hidden}] bf16 on {a.tp_size} GPUs "
              f"({torch.cuda.get_device_name(0)}), us per call in a CUDA graph")
        for n, times, same in rows:
            print(f"{n:4d} rows: " + "; ".join(
                f"{name} {times[name] * 1e3:.1f}" + ("" if same[name] is True else f" ({same[name] or 'DIFFERS'})")
                for name in times))
        return
    print(f"all-reduce of bf16 on {a.tp_size} GPUs ({torch.cuda.get_device_name(0)}), ms per call in a CUDA graph")
    for kib, t_nccl, t_one, same in rows:
        print(f"{kib:6d} KiB: NCCL {t_nccl * 1e3:7.1f} us, one-shot {t_one * 1e3:7.1f} us "
              f"({t_nccl / t_one:.2f}x){'' if same else '  RESULTS DIFFER'}")


if __name__ == "__main__":
    main()
