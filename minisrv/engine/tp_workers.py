"""Tensor parallelism's ranks as processes, each node's own: node 0's rank 0 (the engine) spawns, watches and reaps
ranks 1..n-1; on a node k > 0 (--node-rank), `serve_node` does the same for ranks k*n..k*n+n-1 (n = tp_size /
nnodes); all of them meet at one rendezvous address.

What a rank 1..N-1 runs in its spawned process (`rank_main`): build its shard's parts, then follow rank 0. It
receives each step's `StepInputs` from rank 0, runs the same forward (the collectives inside meet rank 0's), and
receives the sampled ids so that it reads the same pending decode inputs. A stop message in place of a step ends it.

A rank that fails before it has started (usually a script without an `if __name__ == "__main__":` guard, which
every spawned rank imports again) makes rank 0 raise at once with the reason and the fix, instead of waiting for a
rank that will never join. A rank that dies later is noticed by its exit, not by a timeout, and a node that is lost
by its heartbeats (node_watch.py): the watcher names it, stops the local ranks, and ends the engine with an error (on
CUDA, or with a node lost, a collective waiting for the lost peer may never return, so after a grace period the
watcher ends rank 0's process itself).
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
from typing import Any, Callable, List, Optional, Tuple

from minisrv.config import EngineConfig, setup_logging
from minisrv.distributed import (NO_MULTICAST_ENV, Rendezvous, TensorParallelError, destroy_tensor_parallel,
                                 drop_process_group, new_rendezvous)
from minisrv.utils import freeze_startup_heap

from .node_watch import NodeWatch
from .setup import EngineParts, build_engine_parts, check_tensor_parallel, resolve_device

logger = logging.getLogger("minisrv")

STOP_TIMEOUT_S = 10.0  # a rank that has not exited this long after being told to stop is killed
HUNG_RANK0_GRACE_S = 15.0  # after a loss, rank 0 stuck this long in a collective ends its process
START_TIMEOUT_S = 600.0  # a rank that has neither started (imports done) nor died this long after its spawn is lost
GUARD_HINT = ("ranks are spawned processes that import the launching script again: if it builds the engine (LLM(...), "
              "Engine(...)) at module level, guard its entry point with `if __name__ == \"__main__\":`")

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
        runner = build_engine_parts(cfg, tp_rank=rank, rendezvous=rendezvous).runner
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


class TPWorkers:
    """This node's processes of `ranks` (not rank 0), a thread that watches them die, and on a group of several
    nodes the watch over the others (`nodes`)."""

    def __init__(self, cfg: EngineConfig, rendezvous: Rendezvous, cuda: bool, ranks: range) -> None:
        for k, v in NO_MULTICAST_ENV.items():  # spawned children inherit the environment
            os.environ.setdefault(k, v)
        ctx = mp.get_context("spawn")
        self.ranks = ranks
        self.started = [ctx.Event() for _ in ranks]  # set by each rank once its imports are done
        self.procs = [ctx.Process(target=rank_main, args=(cfg, rank, rendezvous, os.getpid(), started),
                                  name=f"minisrv-tp{rank}", daemon=False)
                      for rank, started in zip(ranks, self.started)]
        for p in self.procs:
            p.start()
        self.cuda = cuda
        self.lost: Optional[str] = None  # why the group is broken, once a rank or a node is lost
        self.acknowledged = threading.Event()  # rank 0 raised the loss (it is not stuck in a collective)
        self.joined = threading.Event()  # rank 0's parts are built: the group has formed
        self._stopping = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="minisrv-tp-watch", daemon=True)
        self._watcher.start()
        self.nodes: Optional[NodeWatch] = None  # several nodes: the watch over the others (its owner sets it)

    def _watch(self) -> None:
        live = {p.sentinel: (rank, p) for rank, p in zip(self.ranks, self.procs)}
        while live and not self._stopping.is_set():
            ended = mp.connection.wait(list(live), timeout=0.5)
            if self._stopping.is_set():
                return  # stop() reaps them (two threads reaping one child can each see it running a moment)
            for sentinel in ended:
                rank, proc = live.pop(sentinel)
                proc.join(1.0)
                if proc.exitcode != 0:  # 0: it was told to stop (see rank_main)
                    # a CUDA collective never returns without its peer; before the group has formed, neither does
                    # the rendezvous on any device
                    return self.lose(_exited(rank, proc), self.cuda or not self.joined.is_set())

    def lose(self, reason: str, may_hang: bool) -> None:
        """The group is broken: say why, kill the local ranks, and if rank 0 `may_hang` in a collective and does not
        raise the loss (`check`) within a grace period, end its process."""
        if self._stopping.is_set() or self.lost is not None:
            return
        self.lost = reason
        logger.error("%s: the engine stops", reason)
        self._kill_all()
        if may_hang and not self.acknowledged.wait(HUNG_RANK0_GRACE_S):
            logger.error("rank 0 has not raised the loss in %.0f s (idle, or stuck in a collective); ending the "
                         "engine process", HUNG_RANK0_GRACE_S)
            os._exit(1)

    def wait_started(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Wait until every rank has started (its process imported what it runs); raise TensorParallelError naming
        a rank that exited first, with the usual cause."""
        deadline = time.monotonic() + timeout_s
        for rank, proc, started in zip(self.ranks, self.procs, self.started):
            while not started.wait(0.1):
                if not proc.is_alive():
                    self.lost = f"{_exited(rank, proc)} before it started (its error is printed above); {GUARD_HINT}"
                elif time.monotonic() > deadline:
                    self.lost = f"tensor-parallel rank {rank} (pid {proc.pid}) did not start within {timeout_s:.0f} s"
                else:
                    continue
                self.check()  # raises the loss

    def check(self, failure: Optional[Exception] = None) -> None:
        """Raise TensorParallelError if a rank is gone, or if a step's `failure` says the group is broken (a
        TensorParallelError: a rank ending then is given a moment to be seen gone, as its socket closes before its
        process can be reaped, so that the error names it)."""
        broken = isinstance(failure, TensorParallelError)
        if self.lost is None and self.procs:
            ended = mp.connection.wait([p.sentinel for p in self.procs], 1.0 if broken else 0.0)
            for rank, p in zip(self.ranks, self.procs):
                if p.sentinel in ended or not p.is_alive():
                    self.lost = _exited(rank, p)
                    break
        if self.lost is None and broken:
            self.lost = str(failure)  # (a rank on another node, or rank 0's own step): stop() sends it nothing
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
        if self.nodes is not None:
            self.nodes.stop()
        if self.lost is None and all(p.is_alive() for p in self.procs):
            try:
                send_stop()
                teardown()
            except Exception as e:  # noqa: BLE001 - a broken group: the ranks are killed below
                logger.warning("could not stop the tensor-parallel ranks in order: %s", e)
        deadline = time.monotonic() + (STOP_TIMEOUT_S if self.lost is None else 0.0)  # a broken group's ranks
        for p in self.procs:  # do not end by themselves
            p.join(max(0.0, deadline - time.monotonic()))
        self._kill_all()


def _exited(rank: int, proc: mp.Process, join_s: float = 1.0) -> str:
    """Why `proc` is gone, with its exit code. Two threads (the watcher, `check`) may reap one child: the one whose
    wait finds it already reaped reads no code until the other has stored it, so the code is awaited up to join_s."""
    deadline = time.monotonic() + join_s
    proc.join(join_s)
    while proc.exitcode is None and time.monotonic() < deadline:
        time.sleep(0.01)
    return f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code {proc.exitcode}"


def free_tcp_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def _rendezvous(cfg: EngineConfig) -> Rendezvous:
    if cfg.nnodes > 1:  # every node's ranks are new processes: their group names start at 0 (see Rendezvous)
        return Rendezvous(f"tcp://{cfg.dist_init_addr}", 0, cfg.dist_timeout)
    return new_rendezvous(f"tcp://{cfg.dist_init_addr}" if cfg.dist_init_addr else free_tcp_address(), cfg.dist_timeout)


def build_tensor_parallel_parts(cfg: EngineConfig) -> EngineParts:
    """Rank 0 of a tensor-parallel engine: refuse what can be refused, spawn this node's ranks 1..n-1, wait until
    they have started, then build rank 0's parts (joining the group with every node's ranks). The ranks are stopped
    if anything fails."""
    check_tensor_parallel(cfg)
    if cfg.node_rank > 0:
        raise ValueError(f"node {cfg.node_rank} runs only its tensor-parallel ranks, no engine: start it with "
                         f"`python -m minisrv.launch_server ... --node-rank {cfg.node_rank}`")
    rendezvous = _rendezvous(cfg)
    workers = TPWorkers(cfg, rendezvous, resolve_device(cfg).type == "cuda", range(1, cfg.ranks_per_node))
    if cfg.nnodes > 1:
        workers.nodes = NodeWatch(cfg, lambda why: workers.lose(why, True))
    try:
        workers.wait_started()
        parts = build_engine_parts(cfg, 0, rendezvous)
        workers.joined.set()
    except BaseException:
        workers.stop(lambda: None, lambda: None)
        drop_process_group(5.0)  # (its ranks are gone: the caller's process is left without a group, as it came)
        raise
    parts.workers = workers
    return parts


def serve_node(cfg: EngineConfig) -> int:
    """A node k > 0 of a multi-node group: run its ranks until rank 0 stops them (0: they all exited 0), or until a
    rank fails or another node is lost (1, after saying why here and to the other nodes)."""
    check_tensor_parallel(cfg)
    n = cfg.ranks_per_node
    ranks = range(cfg.node_rank * n, (cfg.node_rank + 1) * n)
    logger.warning("node %d of %d: tensor-parallel ranks %d-%d join at %s", cfg.node_rank, cfg.nnodes, ranks[0],
                   ranks[-1], cfg.dist_init_addr)
    workers = TPWorkers(cfg, _rendezvous(cfg), resolve_device(cfg).type == "cuda", ranks)
    workers.acknowledged.set()  # no rank 0 in this process to be stuck in a collective
    node_lost: List[Tuple[str, float]] = []  # (why, when): rank 0's teardown also ends the store, so the ranks
    workers.nodes = NodeWatch(cfg, lambda why: node_lost.append((why, time.monotonic())))  # get a moment to end
    try:
        workers.wait_started()
        while workers.lost is None and any(p.exitcode is None for p in workers.procs):
            if node_lost and time.monotonic() - node_lost[0][1] > STOP_TIMEOUT_S:
                break
            time.sleep(0.2)
    except TensorParallelError:
        pass
    except KeyboardInterrupt:
        node_lost.append(("interrupted", 0.0))
    failed = not all(p.exitcode == 0 for p in workers.procs)
    if failed:
        why = (node_lost[0][0] if node_lost else workers.lost) or "a rank failed"
        workers.lost = workers.lost or why  # its ranks are killed at once
        workers.nodes.stop(why)  # told to the other nodes
    workers.stop(lambda: None, lambda: None)
    if failed:
        logger.error("node %d: %s; its ranks are stopped", cfg.node_rank, why)
        return 1
    return 0
