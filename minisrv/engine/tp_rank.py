"""What a tensor-parallel rank 1..N-1 runs in its spawned process: build its shard's parts, then follow rank 0.

It receives each step's `StepInputs` from rank 0, runs the same forward (the collectives inside meet rank 0's), and
receives the sampled ids so that it reads the same pending decode inputs. A stop message in place of a step ends it.
"""
from __future__ import annotations

import ctypes
import logging
import os
import signal
import traceback
from typing import Any

from minisrv.config import EngineConfig, setup_logging
from minisrv.distributed import Rendezvous, destroy_tensor_parallel
from minisrv.utils import freeze_startup_heap

from .setup import build_engine_parts

logger = logging.getLogger("minisrv")

# what rank 0 sends the other ranks instead of a step: stop, tearing the process group down together (an engine
# closed in a process that goes on), or stop at once (the process is exiting)
STOP_AND_TEAR_DOWN = "stop-and-tear-down"
STOP_NOW = "stop-now"


def _die_with_parent() -> None:
    """Linux: the kernel kills this process when its parent (rank 0) dies, however it dies."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def rank_main(cfg: EngineConfig, rank: int, rendezvous: Rendezvous, parent_pid: int, started: Any) -> None:
    """Entry point of rank `rank` (spawned). `started` (an event) is set once this process has come this far: its
    imports, the launching script's included, succeeded (see TPWorkers.wait_started)."""
    _die_with_parent()
    if os.getppid() != parent_pid:  # the parent died before the line above took effect
        os._exit(1)
    started.set()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group; rank 0 decides
    setup_logging("warning" if cfg.log_level.lower() == "info" else cfg.log_level)
    try:
        parts = build_engine_parts(cfg, tp_rank=rank, rendezvous=rendezvous)
        runner = parts.runner
        freeze_startup_heap()
        while True:
            inp = runner.tp.recv_object()
            if inp in (STOP_AND_TEAR_DOWN, STOP_NOW):
                break
            runner.run_remote_step(inp)
    except BaseException:  # noqa: BLE001 - any failure ends this rank; rank 0 notices the exit
        logger.error("tensor-parallel rank %d failed:\n%s", rank, traceback.format_exc())
        os._exit(1)
    if inp == STOP_AND_TEAR_DOWN:
        runner.release_graphs()
        destroy_tensor_parallel(runner.tp)  # at the same time as rank 0's (see Engine.close)
    os._exit(0)
