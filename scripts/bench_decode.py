#!/usr/bin/env python
"""Decode-only step time at given batch sizes, CUDA graphs on and off, against the memory-bandwidth floor.

Each request gets a prompt of --context tokens; after the prefill, --steps consecutive decode steps are timed
together, up to the end of the last one's device work (with overlap scheduling a step returns before its own work
ends), and the mean step time is reported: with --repeats N, N such runs one after another (the contexts growing)
and their median, each run's figure printed beside it (a single run can catch a stall of the host; a run's full garbage
collections are printed). The floor is the bytes a step must read (weights once, plus every request's KV) over
--bandwidth; of a mixture-of-experts layer's experts, only those the batch is expected to hit
(E * (1 - (1 - 1/E)^(batch * k)) of E, for routing spread evenly).

  python scripts/bench_decode.py --model /tmp/qwen3 --attention-backend fa,fi --batch-sizes 1,64,256
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from minisrv.config import EngineConfig  # noqa: E402
from minisrv.kvcache import KVPool  # noqa: E402
from minisrv.engine.request import SamplingParams  # noqa: E402
from minisrv.utils import freeze_startup_heap  # noqa: E402


class FullCollections:
    """Python's full (generation 2) garbage collections while in the block: how many, and their milliseconds (a
    collection that walks every object of the process stalls the host for tens of milliseconds)."""

    def __init__(self):
        self.count, self.ms, self._t = 0, 0.0, 0.0

    def _watch(self, phase, info):
        if info["generation"] == 2:
            if phase == "start":
                self._t = time.perf_counter()
            else:
                self.count += 1
                self.ms += (time.perf_counter() - self._t) * 1e3

    def __enter__(self):
        gc.callbacks.append(self._watch)
        return self

    def __exit__(self, *exc):
        gc.callbacks.remove(self._watch)


def timed_steps(eng, steps: int, torch_profile: bool, cprofile: bool, bs: int):
    """(seconds a step, milliseconds the host waited for the device a step) over `steps` consecutive decode steps,
    up to the end of the last one's device work; the profilers print what they saw."""
    prof = None
    if torch_profile:
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                  torch.profiler.ProfilerActivity.CUDA])
        prof.__enter__()
    # with overlap scheduling a step returns before its own work is done, so time a run of steps
    torch.cuda.synchronize() if torch.cuda.is_available() else None
    wait0 = eng.runner.wait_s
    cprof = None
    if cprofile:
        import cProfile
        cprof = cProfile.Profile()
        cprof.enable()
    with FullCollections() as collections:
        t = time.perf_counter()
        for _ in range(steps):  # each call launches one step (and processes the one before it)
            eng.step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the last launched step's work is done
        step_s = (time.perf_counter() - t) / steps
    if collections.count:
        print(f"batch {bs}: {collections.count} full garbage collection(s) in the run, {collections.ms:.1f} ms")
    if cprof is not None:
        import pstats
        cprof.disable()
        print(f"batch {bs}: host Python functions over {steps} steps")
        pstats.Stats(cprof).sort_stats("tottime").print_stats(25)
    wait_ms = (eng.runner.wait_s - wait0) / steps * 1e3
    if prof is not None:
        prof.__exit__(None, None, None)
        evs = prof.key_averages()
        busy = sum(getattr(e, "self_device_time_total", 0) for e in evs
                   if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA)
        comm = sum(getattr(e, "self_device_time_total", 0) for e in evs
                   if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA
                   and "nccl" in e.key.lower())
        print(f"batch {bs}: device busy {busy / 1e3 / steps:.3f} ms/step (kernels and copies), "
              f"wall {step_s * 1e3:.3f} ms/step; NCCL kernels {comm / 1e3 / steps:.3f} ms/step "
              f"({100 * comm / max(busy, 1):.0f}% of device time, rank 0)")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=60))
        print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=60))
    return step_s, wait_ms


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    EngineConfig.add_cli_args(p)
    p.add_argument("--batch-sizes", default="1,64,256")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--repeats", type=int, default=1, help="timed runs of --steps each; the median is reported")
    p.add_argument("--bandwidth", type=float, default=3.0e12, help="bytes/s for the floor")
    p.add_argument("--graphs", default="on,off", help="on, off or on,off")
    p.add_argument("--json", help="append results as JSON lines here")
    p.add_argument("--torch-profile", action="store_true", help="print the top kernels of the timed steps")
    p.add_argument("--cprofile", action="store_true", help="print the host's top Python functions in the timed steps")
    p.set_defaults(log_level="warning")  # (the engine's own default is info)
    a = p.parse_args()
    sizes = [int(x) for x in a.batch_sizes.split(",")]
    from minisrv.llm import LLM
    rows = []
    for mode in a.graphs.split(","):
        cfg = EngineConfig.from_args(a)
        cfg.disable_cuda_graph = mode == "off"
        cfg.max_running_requests = max(cfg.max_running_requests, max(sizes))
        t0 = time.perf_counter()
        llm = LLM(**vars(cfg))
        ready = time.perf_counter() - t0
        freeze_startup_heap()  # as the generate script and the server's engine process do
        eng = llm.engine
        ar = eng.parts.args
        weights = sum(q.numel() * q.element_size() for q in eng.runner.model.parameters())
        expert_bytes = sum(q.numel() * q.element_size() for n, q in eng.runner.model.named_parameters()
                           if ".experts." in n)
        # one rank's bytes: its shard of the weights and its K/V heads (with tensor parallelism)
        kv_tok = KVPool.bytes_per_token(ar.num_layers, eng.parts.pool.num_kv_heads, ar.head_dim,
                                        eng.parts.pool.kv_dtype)
        for bs in sizes:
            params = SamplingParams(temperature=0, max_tokens=a.steps * a.repeats + 8, ignore_eos=True)
            reqs = [eng.add_request([(7 * i + j) % 1000 + 1 for j in range(a.context)], params) for i in range(bs)]
            while any(len(r.output_ids) == 0 for r in reqs):  # prefill everything first
                eng.step()
            times, waits = [], []
            for run in range(a.repeats):  # the profilers watch the first run only
                step_s, wait_ms = timed_steps(eng, a.steps, a.torch_profile and run == 0, a.cprofile and run == 0, bs)
                times.append(step_s)
                waits.append(wait_ms)
            wait_ms = statistics.median(waits)
            for r in reqs:
                eng.abort(r.rid)
            med = statistics.median(times)
            hit = 1.0 if not ar.num_experts else 1 - (1 - 1 / ar.num_experts) ** (bs * ar.experts_per_token)
            read = weights - expert_bytes * (1 - hit)
            floor = (read + bs * (a.context + a.steps * a.repeats // 2) * kv_tok) / a.bandwidth
            row = {"backend": eng.parts.backend_name, "graphs": mode, "batch": bs, "context": a.context,
                   "step_ms": round(med * 1e3, 3), "floor_ms": round(floor * 1e3, 3),
                   "of_floor": round(floor / med, 2), "ready_s": round(ready, 1),
                   "capture_s": getattr(eng.runner.graph_runner, "capture_s", None)}
            row["tp_size"] = cfg.tp_size
            rows.append(row)
            row["host_wait_ms"] = round(wait_ms, 3)
            row["runs_ms"] = [round(x * 1e3, 3) for x in times]
            runs = f" (runs {' / '.join(f'{x * 1e3:.3f}' for x in times)})" if len(times) > 1 else ""
            print(f"tp {cfg.tp_size} {eng.parts.backend_name:6s} graphs {mode:3s} batch {bs:4d}: "
                  f"step {med * 1e3:8.3f} ms"
                  f"{runs}; floor {floor * 1e3:7.3f} ms ({100 * floor / med:.0f}% of floor); host waited "
                  f"{wait_ms:.3f} ms a step", flush=True)
        llm.close()  # tensor-parallel ranks end here
        gc.unfreeze()  # so that the engine's cycles are collected before the next one is built
        del llm, eng
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    if a.json:
        with open(a.json, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
