"""Tensor parallelism's other ranks: processes 1..N-1, spawned and reaped by rank 0's engine.

Rank 0 runs the engine (scheduler, sampling, text) and its shard of the model. Each other rank builds the same
parts for its own shard and then only follows: it receives each step's `StepInputs` from rank 0, runs the same
forward (the collectives inside meet rank 0's), and receives the sampled ids so that it reads the same pending
decode inputs. `None` in place of a step ends it.

A rank that dies is noticed by its exit, not by a timeout: rank 0's watcher names it, stops the others, and ends
the engine with an error (on the CPU the next collective fails at once; on CUDA a collective waiting for a dead peer
never returns, so after a grace period the watcher ends rank 0's process itself). A rank whose parent dies is
killed by the kernel (PR_SET_PDEATHSIG), so no rank outlives its engine.
"""
from __future__ import annotations

import ctypes
import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import signal
import socket
import threading
import time
import traceback
from typing import Callable, Optional

from minisrv.config import EngineConfig
from minisrv.distributed import NO_MULTICAST_ENV, Rendezvous, TensorParallelError

logger = logging.getLogger("minisrv")

STOP_TIMEOUT_S = 10.0  # a rank that has not exited this long after being told to stop is killed
HUNG_RANK0_GRACE_S = 15.0  # CUDA: after a rank died, rank 0 stuck this long in a collective ends its process


def free_tcp_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


class TPWorkers:
    """The processes of ranks 1..size-1 and a thread that watches them die."""

    def __init__(self, cfg: EngineConfig, rendezvous: Rendezvous, cuda: bool) -> None:
        for k, v in NO_MULTICAST_ENV.items():  # spawned children inherit the environment
            os.environ.setdefault(k, v)
        ctx = mp.get_context("spawn")
        self.procs = [ctx.Process(target=worker_main, args=(cfg, rank, rendezvous, os.getpid()),
                                  name=f"minisrv-tp{rank}", daemon=False)
                      for rank in range(1, cfg.tp_size)]
        for p in self.procs:
            p.start()
        self.cuda = cuda
        self.lost: Optional[str] = None  # why the group is broken, once a rank died
        self.acknowledged = threading.Event()  # rank 0 raised the loss (it is not stuck in a collective)
        self._stopping = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="minisrv-tp-watch", daemon=True)
        self._watcher.start()

    def _watch(self) -> None:
        live = {p.sentinel: rank for rank, p in enumerate(self.procs, start=1)}
        while live and not self._stopping.is_set():
            ended = mp.connection.wait(list(live), timeout=0.5)
            if self._stopping.is_set():
                return
            if not ended:
                continue
            rank = live[ended[0]]
            proc = self.procs[rank - 1]
            proc.join(1.0)
            self.lost = f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code {proc.exitcode}"
            logger.error("%s: the engine stops", self.lost)
            self._kill_all()
            if self.cuda and not self.acknowledged.wait(HUNG_RANK0_GRACE_S):
                logger.error("rank 0 is stuck in a collective with the lost rank; ending the engine process")
                os._exit(1)
            return

    def check(self) -> None:
        """Raise TensorParallelError if a rank is gone (a step failure may be its echo)."""
        if self.lost is None:
            for rank, p in enumerate(self.procs, start=1):
                if not p.is_alive():
                    p.join(0.2)
                    self.lost = f"tensor-parallel rank {rank} (pid {p.pid}) exited with code {p.exitcode}"
                    break
        if self.lost is not None:
            self.acknowledged.set()
            raise TensorParallelError(self.lost)

    def _kill_all(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(STOP_TIMEOUT_S)

    def stop(self, send_stop: Callable[[], None], teardown: Callable[[], None]) -> None:
        """Tell the ranks to end (send_stop sends them None), tear the process group down together with them
        (`teardown`: its collective part needs every rank), wait for them, kill what lingers; always reaps.
        A group that lost a rank is not torn down (its teardown would wait for the lost rank)."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        if self.lost is None and all(p.is_alive() for p in self.procs):
            try:
                send_stop()
                teardown()
            except Exception as e:  # noqa: BLE001 - a broken group: the ranks are killed below
                logger.warning("could not stop the tensor-parallel ranks in order: %s", e)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        self._kill_all()


def _die_with_parent() -> None:
    """Linux: the kernel kills this process when its parent (rank 0) dies, however it dies."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


# what rank 0 sends the other ranks instead of a step: stop, tearing the process group down together (an engine
# closed in a process that goes on), or stop at once (the process is exiting)
STOP_AND_TEAR_DOWN = "stop-and-tear-down"
STOP_NOW = "stop-now"


def worker_main(cfg: EngineConfig, rank: int, rendezvous: Rendezvous, parent_pid: int) -> None:
    """Entry point of rank `rank` (spawned): build this rank's parts, then follow rank 0's steps until told to stop."""
    _die_with_parent()
    if os.getppid() != parent_pid:  # the parent died before the line above took effect
        os._exit(1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group; rank 0 decides
    from .setup import build_engine_parts, setup_logging
    setup_logging("warning" if cfg.log_level.lower() == "info" else cfg.log_level)
    try:
        parts = build_engine_parts(cfg, tp_rank=rank, rendezvous=rendezvous)
        runner = parts.runner
        while True:
            inp = runner.tp.recv_object()
            if inp in (STOP_AND_TEAR_DOWN, STOP_NOW):
                break
            runner.run_remote_step(inp)
    except BaseException:  # noqa: BLE001 - any failure ends this rank; rank 0 notices the exit
        logger.error("tensor-parallel rank %d failed:\n%s", rank, traceback.format_exc())
        os._exit(1)
    if inp == STOP_AND_TEAR_DOWN:
        from minisrv.distributed import destroy_tensor_parallel
        runner.release_graphs()
        destroy_tensor_parallel(runner.tp)  # at the same time as rank 0's (see Engine.close)
    os._exit(0)
