"""Where a step's time goes, for benchmarks: `time_phases(engine)` wraps the engine's phase methods on that one
engine (nothing in the step path checks for it) and charges each call's time to its phase. The device is
synchronised after each device phase, so the time is the phase's own and overlap is lost while it is on."""
from __future__ import annotations

import functools
import time
from collections import defaultdict
from typing import Any, Callable, Dict, Optional

import torch


def time_phases(engine: Any) -> Dict[str, float]:
    """Phase -> seconds, accumulated from now on: schedule, metadata (step inputs and their tensors),
    forward_extend / forward_decode, sampling, postprocess (the finish checks and text of each new token)."""
    timings: Dict[str, float] = defaultdict(float)
    runner = engine.runner
    device = runner.device

    def wrap(owner: Any, name: str, phase: Callable[..., str], sync: bool) -> None:
        inner = getattr(owner, name)

        @functools.wraps(inner)
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            out = inner(*args, **kwargs)
            if sync and device.type == "cuda":
                torch.cuda.synchronize(device)
            timings[phase(*args)] += time.perf_counter() - t0
            return out

        setattr(owner, name, timed)

    def named(name: str) -> Callable[..., str]:
        return lambda *args: name

    def forward_phase(inp: Any, fb: Optional[Any] = None, aux: Optional[Any] = None) -> str:
        return "forward_decode" if fb.is_decode else "forward_extend"

    wrap(engine.scheduler, "schedule", named("schedule"), sync=False)
    wrap(runner, "step_inputs", named("metadata"), sync=True)
    wrap(runner, "forward_batch", named("metadata"), sync=True)
    wrap(runner, "_forward", forward_phase, sync=True)
    wrap(runner, "_queue_sampling", named("sampling"), sync=True)
    wrap(engine, "_news", named("postprocess"), sync=False)
    return timings
