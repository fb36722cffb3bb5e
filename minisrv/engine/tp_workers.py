"""Tensor parallelism's other ranks as processes: ranks 1..N-1, spawned, watched and reaped by rank 0's engine
(what each of them runs is tp_rank.py).

A rank that fails before it has started (usually a script without an `if __name__ == "__main__":` guard, which
every spawned rank imports again) makes rank 0 raise at once with the reason and the fix, instead of waiting for a
rank that will never join. A rank that dies later is noticed by its exit, not by a timeout: rank 0's watcher names
it, stops the others, and ends the engine with an error (on CUDA a collective waiting for a dead peer never returns,
so after a grace period the watcher ends rank 0's process itself).
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import socket
import threading
import time
from typing import Callable, Optional

from minisrv.config import EngineConfig
from minisrv.distributed import NO_MULTICAST_ENV, Rendezvous, TensorParallelError, new_rendezvous

from .setup import EngineParts, build_engine_parts, check_tensor_parallel, resolve_device
from .tp_rank import rank_main

logger = logging.getLogger("minisrv")

STOP_TIMEOUT_S = 10.0  # a rank that has not exited this long after being told to stop is killed
HUNG_RANK0_GRACE_S = 15.0  # CUDA: after a rank died, rank 0 stuck this long in a collective ends its process
START_TIMEOUT_S = 600.0  # a rank that has neither started (imports done) nor died this long after its spawn is lost
GUARD_HINT = ("ranks are spawned processes that import the launching script again: if it builds the engine (LLM(...), "
              "Engine(...)) at module level, guard its entry point with `if __name__ == \"__main__\":`")


class TPWorkers:
    """The processes of ranks 1..size-1 and a thread that watches them die."""

    def __init__(self, cfg: EngineConfig, rendezvous: Rendezvous, cuda: bool) -> None:
        for k, v in NO_MULTICAST_ENV.items():  # spawned children inherit the environment
            os.environ.setdefault(k, v)
        ctx = mp.get_context("spawn")
        self.started = [ctx.Event() for _ in range(1, cfg.tp_size)]  # set by each rank once its imports are done
        self.procs = [ctx.Process(target=rank_main, args=(cfg, rank, rendezvous, os.getpid(), started),
                                  name=f"minisrv-tp{rank}", daemon=False)
                      for rank, started in zip(range(1, cfg.tp_size), self.started)]
        for p in self.procs:
            p.start()
        self.cuda = cuda
        self.lost: Optional[str] = None  # why the group is broken, once a rank died
        self.acknowledged = threading.Event()  # rank 0 raised the loss (it is not stuck in a collective)
        self.joined = threading.Event()  # rank 0's parts are built: the group has formed
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
            self.lost = _exited(rank, self.procs[rank - 1], 1.0)
            logger.error("%s: the engine stops", self.lost)
            self._kill_all()
            # a CUDA collective never returns without its peer; before the group has formed, neither does the
            # rendezvous on any device
            if (self.cuda or not self.joined.is_set()) and not self.acknowledged.wait(HUNG_RANK0_GRACE_S):
                logger.error("rank 0 is stuck waiting for the lost rank; ending the engine process")
                os._exit(1)
            return

    def wait_started(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Wait until every rank has started (its process imported what it runs); raise TensorParallelError naming
        a rank that exited first, with the usual cause."""
        deadline = time.monotonic() + timeout_s
        for rank, (proc, started) in enumerate(zip(self.procs, self.started), start=1):
            while not started.wait(0.1):
                if not proc.is_alive():
                    self.lost = (f"{_exited(rank, proc, 1.0)} before it started (its error is printed above); "
                                 f"{GUARD_HINT}")
                    self.acknowledged.set()
                    raise TensorParallelError(self.lost)
                if time.monotonic() > deadline:
                    self.lost = f"tensor-parallel rank {rank} (pid {proc.pid}) did not start within {timeout_s:.0f} s"
                    self.acknowledged.set()
                    raise TensorParallelError(self.lost)

    def check(self) -> None:
        """Raise TensorParallelError if a rank is gone (a step failure may be its echo)."""
        if self.lost is None:
            for rank, p in enumerate(self.procs, start=1):
                if not p.is_alive():
                    self.lost = _exited(rank, p, 0.2)
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
        """Tell the ranks to end (send_stop), tear the process group down together with them
        (`teardown`: its collective part needs every rank), wait for them, kill what lingers; always reaps.
        A group that lost a rank is not torn down (its teardown would wait for the lost rank)."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        self.acknowledged.set()  # rank 0 is here, not stuck in a collective
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


def _exited(rank: int, proc: mp.Process, join_s: float) -> str:
    proc.join(join_s)
    return f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code {proc.exitcode}"


def free_tcp_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def build_tensor_parallel_parts(cfg: EngineConfig) -> EngineParts:
    """Rank 0 of a tensor-parallel engine: refuse what can be refused, spawn ranks 1..N-1, wait until they have
    started, then build rank 0's parts (joining the group with them). The ranks are stopped if anything fails."""
    check_tensor_parallel(cfg)
    rendezvous = new_rendezvous(free_tcp_address())
    workers = TPWorkers(cfg, rendezvous, resolve_device(cfg).type == "cuda")
    try:
        workers.wait_started()
        parts = build_engine_parts(cfg, 0, rendezvous)
        workers.joined.set()
    except BaseException:
        workers.stop(lambda: None, lambda: None)
        raise
    parts.workers = workers
    return parts
