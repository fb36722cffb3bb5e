"""Liveness of the nodes of a tensor-parallel group that spans machines (--nnodes > 1).

Why: a rank waits for rank 0's next step without a time limit (an idle server sends none), and a machine or network
that vanishes closes no socket, so no collective fails. So each node keeps a counter going in torch's TCP store at
--dist-init-addr (hosted by rank 0's process on node 0) and reads the others'. A node whose counter has started and
then stands still for NODE_SILENT_S, that wrote why it stopped, or a store that stops answering (node 0 is gone) is
lost, and the watch says so once (`on_lost`), which ends this node's part of the group.
"""
from __future__ import annotations

import datetime
import threading
import time
from typing import Callable, Dict, Optional, Tuple

from minisrv.config import EngineConfig

HEARTBEAT_S = 1.0  # each node bumps its counter this often
NODE_SILENT_S = 30.0  # a node not heard from this long is lost
STOP_CONNECT_S = 5.0  # a node leaving before its watch reached node 0's store tries this long to say why


def _key(node: int, what: str) -> str:
    """A node's key in the store: its heartbeat counter ("beats"), or why it left the group ("lost")."""
    return f"minisrv/node{node}/{what}"


class NodeWatch:
    """This node's heartbeat and its watch over the other nodes, in a thread (see the module's docstring)."""

    def __init__(self, cfg: EngineConfig, on_lost: Callable[[str], None]) -> None:
        self.node, self.nnodes, self.address = cfg.node_rank, cfg.nnodes, cfg.dist_init_addr
        self.connect_s = float(cfg.dist_timeout)  # node 0's store may not be up yet: it is up once the group forms
        self.on_lost = on_lost
        self._store = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="minisrv-node-watch", daemon=True)
        self._thread.start()

    def _connect(self, timeout_s: float):
        import torch.distributed as dist
        host, _, port = self.address.rpartition(":")  # (an IPv6 host is bracketed)
        store = dist.TCPStore(host.strip("[]"), int(port), is_master=False, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=timeout_s))
        store.set_timeout(datetime.timedelta(seconds=NODE_SILENT_S))
        return store

    def _run(self) -> None:
        try:
            store = self._connect(self.connect_s)
        except Exception as e:  # noqa: BLE001 - torch's store errors vary by version
            return self._lose(f"node 0's store at {self.address} did not answer within {self.connect_s:.0f} s ({e})")
        with self._lock:
            self._store = store
        heard: Dict[int, Tuple[int, float]] = {}  # node -> (its counter, when it last moved)
        while not self._stop.wait(HEARTBEAT_S):
            try:
                with self._lock:
                    store.add(_key(self.node, "beats"), 1)
                    counts = {n: store.add(_key(n, "beats"), 0) for n in range(self.nnodes) if n != self.node}
                    why = {n: store.get(_key(n, "lost")).decode() for n in counts if store.check([_key(n, "lost")])}
            except Exception as e:  # noqa: BLE001 - the store's host process (node 0's rank 0) is gone
                return self._lose(f"node 0 is gone: its store at {self.address} stopped answering ({e})")
            now = time.monotonic()
            for n, count in counts.items():
                if n in why:
                    return self._lose(f"node {n} stopped: {why[n]}")
                if heard.get(n, (None,))[0] != count:
                    heard[n] = (count, now)
                elif count and now - heard[n][1] > NODE_SILENT_S:  # (one never heard from: the join's timeout)
                    return self._lose(f"node {n} has not been heard from for {NODE_SILENT_S:g} s")

    def _lose(self, reason: str) -> None:
        if not self._stop.is_set():
            self.on_lost(reason)

    def stop(self, reason: Optional[str] = None) -> None:
        """Stop beating and watching; `reason`: why this node leaves the group, told to the others."""
        self._stop.set()
        # (the lock is held by a store call waiting on a vanished node 0: not worth waiting for)
        if reason is None or not self._lock.acquire(timeout=1.0):
            return
        try:
            store = self._store or self._connect(STOP_CONNECT_S)  # (the watch may not have reached node 0 yet)
            key = _key(self.node, "lost")
            store.set(key, reason)
            store.get(key)  # set is not answered and this node exits next: a round trip sees it stored
        except Exception:  # noqa: BLE001 - node 0 gone too: the others notice by themselves
            pass
        finally:
            self._lock.release()
