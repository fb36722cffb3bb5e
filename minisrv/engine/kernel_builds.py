"""FlashInfer's kernels built in the background, and the switch to them once they are.

FlashInfer compiles each kernel module with nvcc the first time a process asks for it and keeps the result in its
cache; asked for one by one, as a forward pass meets them, the compilations add up before a new machine's first
answer (docs/benchmarks.md, start-up). Here every module the engine will use is asked for at once, each in a thread
of its own (the compilers run side by side), as soon as the model's shapes are known.

Where the modules are already cached, the builds finish while the weights load. Where they are not, a server does
not wait (`StagedKernels`): it serves at once with kernels that need no compilation (FA3's precompiled attention on
Hopper, torch's norm, activation, rotary and sampling, no CUDA graphs), and between two steps, once everything is
built, points the layers' one LayerOps at FlashInfer's kernels and hands the runner the attention backend asked
for with its CUDA graphs, in one RunnerParts. Sampling switches on its own, as soon as its module is there.
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import replace
from typing import Any, Callable, Dict, Iterable, List, Optional

import torch

from minisrv.models.layer_ops import LayerOps

from .model_runner import ModelRunner, RunnerParts

logger = logging.getLogger("minisrv")


def flashinfer_jobs(device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype, head_dim: int,
                    num_q_heads: int, num_kv_heads: int, prefill_on_fi: bool,
                    decode_on_fi: bool) -> Dict[str, Callable[[], Any]]:
    """What builds (or loads) each FlashInfer module this engine will call, by name: the layers' fused ops, the
    sampling kernel, where FlashInfer runs prefill its paged prefill kernels (the module its prefill wrapper plans
    with), and where FlashInfer decodes a bf16/fp16 pool the decode kernels (the module its decode wrapper plans
    with: FlashInfer's prefill kernels in tensor-core mode, used where 4 or more query heads share a KV head, as
    attention/fi.py chooses). Not built here: the XQA decode over an FP8 pool (built on first use)."""
    from flashinfer.activation import get_act_and_mul_module
    from flashinfer.norm import get_norm_module
    from flashinfer.prefill import get_batch_prefill_module
    from flashinfer.rope import get_rope_module
    from flashinfer.sampling import get_sampling_module

    jobs: Dict[str, Callable[[], Any]] = {
        "norm": get_norm_module,
        "activation": lambda: get_act_and_mul_module("silu"),
        "rotary": get_rope_module,
        "sampling": get_sampling_module,
    }
    if prefill_on_fi:
        from flashinfer.utils import determine_attention_backend
        kind = determine_attention_backend(device, 0, False, False, dtype, kv_dtype)
        jobs["prefill"] = lambda: get_batch_prefill_module(
            kind, dtype, kv_dtype, dtype, torch.int32, head_dim, head_dim, 0, False, False, False)
    if decode_on_fi and kv_dtype == dtype:
        if num_q_heads // num_kv_heads >= 4:
            jobs["decode"] = lambda: get_batch_prefill_module(
                "fa2", dtype, dtype, dtype, torch.int32, head_dim, head_dim, 0, False, False, False)
        else:
            from flashinfer.decode import get_batch_decode_module
            jobs["decode"] = lambda: get_batch_decode_module(
                dtype, dtype, dtype, torch.int32, head_dim, head_dim, 0, False, False)
    return jobs


class KernelBuilds:
    """Named build jobs, each run once in a thread of its own from construction on. A job that fails is logged
    and counts as done: what needs its module then builds it on first use, as without this class."""

    def __init__(self, jobs: Dict[str, Callable[[], Any]]) -> None:
        self.started = time.perf_counter()
        self.names = list(jobs)
        self.seconds: Dict[str, float] = {}
        self._pool = ThreadPoolExecutor(max_workers=max(1, len(jobs)), thread_name_prefix="kernel-build")
        self._futures: Dict[str, Future] = {name: self._pool.submit(self._run, name, job) for name, job in jobs.items()}
        self._pool.shutdown(wait=False)

    def _run(self, name: str, job: Callable[[], Any]) -> None:
        t0 = time.perf_counter()
        try:
            job()
        except Exception as e:  # noqa: BLE001 - a module that cannot be built here is built (or fails) on use
            logger.warning("building the %s kernels in the background failed (%s: %s); they are built on "
                           "first use instead", name, type(e).__name__, e)
        self.seconds[name] = time.perf_counter() - t0

    def done(self, names: Optional[Iterable[str]] = None) -> bool:
        return self.wait(names, timeout=0)

    def wait(self, names: Optional[Iterable[str]] = None, timeout: Optional[float] = None) -> bool:
        """Wait for the named jobs (all by default), at most `timeout` seconds; whether they are done (a job's
        error is caught and logged in _run)."""
        futures = [self._futures[n] for n in (self.names if names is None else names) if n in self._futures]
        return not wait(futures, timeout).not_done

    def pending(self) -> List[str]:
        return [n for n in self.names if not self._futures[n].done()]

    def report(self) -> str:
        return ", ".join(f"{n} {self.seconds[n]:.1f}s" for n in self.names if n in self.seconds)


class StagedKernels:
    """A server's engine that started before its FlashInfer kernels were built, or before its CUDA graphs were
    captured, and the switch to them (`upgrade`), run by the engine between two steps with nothing in flight.

    ops: the model's layer ops, to point at `kernels` once built; final_parts(current): the runner's parts with the
    attention backend asked for and its CUDA graphs; sampling_kernel(): the fused sampling function.

    graphs_only: every kernel is built and only the graphs wait (a first request would otherwise wait for their
    capture): they are captured once the engine, having run a step, is idle for a moment (before any step the HTTP
    side may still be starting), or after IDLE_BEFORE_ANY_STEP_S of idleness without one, or between two steps once
    the engine has served GRAPHS_DUE_S seconds, so that a busy server does not decode without them for long."""

    GRAPHS_DUE_S = 2.0
    IDLE_BEFORE_ANY_STEP_S = 10.0

    def __init__(self, builds: KernelBuilds, ops: LayerOps, kernels: Any,
                 final_parts: Callable[[RunnerParts], RunnerParts], attention: str, sampling_kernel: Callable[[], Any],
                 serving: str, layers_pending: bool = True, graphs_only: bool = False) -> None:
        self.builds = builds
        self.ops, self.kernels = ops, kernels
        self.final_parts, self.attention = final_parts, attention
        self.sampling_kernel = sampling_kernel
        self.sampling_switched = "sampling" not in builds.names
        self.layers_switched = not layers_pending
        self.graphs_only = graphs_only
        self.started_serving = time.perf_counter()
        self.first_step: Optional[float] = None  # when the engine began its first step (stepping())
        if graphs_only:
            logger.info("serving at once with %s, without CUDA graphs until the first idle moment", serving)
        else:
            logger.info("FlashInfer's kernels are not built yet (%s: compiling in the background); serving "
                        "meanwhile with %s", ", ".join(builds.pending()) or "none", serving)

    @property
    def finished(self) -> bool:
        return self.layers_switched and self.sampling_switched

    def sampling_ready(self) -> bool:
        return not self.sampling_switched and self.builds.done(["sampling"])

    def stepping(self) -> None:
        """The engine is about to run a step."""
        if self.first_step is None:
            self.first_step = time.perf_counter()

    def layers_ready(self, idle: bool = False) -> bool:
        """Whether the layers and attention can switch now; idle: the engine has had nothing to do for a while."""
        if self.layers_switched or not self.builds.done([n for n in self.builds.names if n != "sampling"]):
            return False
        if not self.graphs_only:
            return True
        now = time.perf_counter()
        if self.first_step is None:
            return idle and now - self.started_serving >= self.IDLE_BEFORE_ANY_STEP_S
        return idle or now - self.first_step >= self.GRAPHS_DUE_S

    def upgrade(self, runner: ModelRunner, idle: bool = False) -> None:
        """Switch what is built: sampling alone as soon as it is, the layers and attention together (CUDA graphs
        captured for them). The runner must have no step in flight."""
        if self.sampling_ready():
            self.sampling_switched = True
            try:
                runner.use_parts(replace(runner.parts, sampling_kernel=self.sampling_kernel()))
                logger.info("sampling now on FlashInfer's kernel (built in %.1fs)",
                            self.builds.seconds.get("sampling", 0.0))
            except Exception:  # noqa: BLE001 - the stand-in keeps serving
                logger.exception("sampling stays on torch's kernels: the switch to FlashInfer's failed")
        if self.layers_ready(idle):
            self.layers_switched = True
            t0 = time.perf_counter()
            try:
                self.ops.use(self.kernels)
                parts = self.final_parts(runner.parts)
            except Exception:  # noqa: BLE001 - a failed switch must not end the engine: stand-ins stay
                self.ops.use(None)
                logger.exception("the layers stay on torch's ops, without CUDA graphs: the switch to "
                                 "FlashInfer's kernels failed (attention: %s)", type(runner.backend).__name__)
            else:
                runner.use_parts(parts)
                graphs = len(parts.graph_runner.graphs) if parts.graph_runner is not None else 0
                logger.info("now serving with FlashInfer's norm, activation and rotary, attention %s, %d decode "
                            "CUDA graphs (switched in %.1fs)", self.attention, graphs, time.perf_counter() - t0)
        if self.finished:
            logger.info("FlashInfer's kernels all serve now, %.1fs after start (built in the background: %s)",
                        time.perf_counter() - self.builds.started, self.builds.report())
