"""Where a step's time goes, for benchmarks: `time_phases(engine)` wraps the engine's phase methods on that one
engine (nothing in the step path checks for it) and charges each call's time to its phase. The device is
synchronised after each device phase, so the time is the phase's own and overlap is lost while it is on."""
from __future__ import annotations

import functools
import time
from collections import defaultdict
from typing import Any, Callable, Dict, Union

import torch


def time_phases(engine: Any) -> Dict[str, float]:
    """Phase -> seconds, accumulated from now on: schedule, metadata (step inputs and their tensors),
    forward_extend / forward_decode, sampling, postprocess (the finish checks and text of each new token)."""
    timings: Dict[str, float] = defaultdict(float)
    runner = engine.runner
    device = runner.device

    def wrap(owner: Any, name: str, phase: Union[str, Callable[..., str]], sync: bool) -> None:
        """phase: its name, or what names it from the call's arguments."""
        inner = getattr(owner, name)

        @functools.wraps(inner)
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            out = inner(*args, **kwargs)
            if sync and device.type == "cuda":
                torch.cuda.synchronize(device)
            timings[phase if isinstance(phase, str) else phase(*args)] += time.perf_counter() - t0
            return out

        setattr(owner, name, timed)

    wrap(engine.scheduler, "schedule", "schedule", sync=False)
    wrap(runner, "step_inputs", "metadata", sync=True)
    wrap(runner, "forward_batch", "metadata", sync=True)
    wrap(runner, "_forward", lambda inp, fb, aux=None: "forward_decode" if fb.is_decode else "forward_extend",
         sync=True)
    wrap(runner, "_queue_sampling", "sampling", sync=True)
    wrap(engine, "_news", "postprocess", sync=False)
    return timings
