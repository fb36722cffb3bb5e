"""Data parallelism (`--dp-size N`): N engine replicas behind the one HTTP server, each an EngineClient with its own
engine process (and tensor-parallel ranks), replica r on GPUs base + r*tp .. base + r*tp + tp - 1.

A request goes to the replica whose radix cache most likely holds the longest prefix of its prompt, unless that one
has AFFINITY_SLACK more requests than the least loaded; with no such replica, to the least loaded (ties in turn).
Which replica holds a prefix is a guess kept here (PrefixIndex: where each recent prompt's whole blocks of tokens
went), never asked of the engines: it costs a hash a block and no round trip. The load is the requests each replica
holds for this server, known here at once (the engines' own reports lag a step).

A replica that dies ends its own requests with an error (EngineClient's watchdog) and is reported by /health; the
others serve on, and the server stops once none is left."""
from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any, Callable, Dict, List, Optional, Sequence

from minisrv.config import EngineConfig
from minisrv.engine.request import SamplingParams

from .engine_proc import EngineClient, EngineDead, Sink
from .messages import EngineInfo

logger = logging.getLogger("minisrv.server")

BLOCK_TOKENS = 32  # prefixes are remembered at whole blocks of this many tokens; a shorter prompt has no affinity
INDEX_BLOCKS = 1 << 17  # the most blocks remembered; the least recently sent go first
AFFINITY_SLACK = 16  # a prefix's replica is passed over once it holds this many more requests than the least loaded


class PrefixIndex:
    """The replica each recently sent prompt prefix went to, by a chained hash of its whole blocks."""

    def __init__(self, capacity: int = INDEX_BLOCKS) -> None:
        self.capacity = capacity
        self.owner: Dict[int, int] = {}  # in order of last use

    @staticmethod
    def keys(ids: Sequence[int]) -> List[int]:
        """One key per whole block: the hash of the prompt up to that block's end."""
        keys, h = [], 0
        for end in range(BLOCK_TOKENS, len(ids) + 1, BLOCK_TOKENS):
            h = hash((h, tuple(ids[end - BLOCK_TOKENS:end])))
            keys.append(h)
        return keys

    def longest(self, keys: List[int]) -> Optional[int]:
        """The replica the longest remembered prefix went to (None: not even the first block is known)."""
        owner = None
        for k in keys:
            if k not in self.owner:
                break
            owner = self.owner[k]
        return owner

    def record(self, keys: List[int], replica: int) -> None:
        for k in keys:
            self.owner.pop(k, None)
            self.owner[k] = replica
        for _ in range(len(self.owner) - self.capacity):
            del self.owner[next(iter(self.owner))]

    def forget(self, replica: Optional[int] = None) -> None:
        """Drop what one replica (None: every replica) was sent."""
        self.owner = {} if replica is None else {k: r for k, r in self.owner.items() if r != replica}


class Replicas:
    """The engine replicas, used by the routes as one engine client (submit, abort, stats, flush_cache)."""

    def __init__(self, cfg: EngineConfig, size: int = 1, staged: bool = True) -> None:
        """staged: engines that answer before their kernels are built (engine_proc.engine_main)."""
        self.cfg = cfg
        self.clients = [EngineClient(dataclasses.replace(
            cfg, base_gpu_id=cfg.base_gpu_id + r * cfg.tp_size, seed=None if cfg.seed is None else cfg.seed + r),
            staged) for r in range(size)]
        self.index = PrefixIndex()
        self.on_death: Optional[Callable[[], None]] = None  # told when the last replica has died
        self.sent = [0] * size  # requests sent to each replica since the start
        self._turn = 0

    def live(self) -> List[int]:
        return [r for r, c in enumerate(self.clients) if c.ready and not c.dead]

    @property
    def ready(self) -> bool:
        return bool(self.live())

    @property
    def dead(self) -> bool:
        return all(c.dead for c in self.clients)

    @property
    def stats(self) -> Dict[str, Any]:
        """The live replicas' engine stats added up (kv_usage: of all their pages)."""
        if len(self.clients) == 1:
            return self.clients[0].stats
        total: Dict[str, Any] = {}
        for r in self.live():
            for k, v in self.clients[r].stats.items():
                total[k] = total.get(k, 0) + v
        if total.get("kv_pages_total"):
            total["kv_usage"] = total["kv_pages_used"] / total["kv_pages_total"]
        return total

    async def start(self) -> EngineInfo:
        """Start every replica at once; raises RuntimeError naming the first that failed (the launcher's shutdown
        stops the others)."""
        infos = await asyncio.gather(*(c.start() for c in self.clients), return_exceptions=True)
        for r, info in enumerate(infos):
            if isinstance(info, BaseException):
                raise RuntimeError(f"replica {r}: {info}" if len(infos) > 1 else str(info)) from info
        for r, c in enumerate(self.clients):
            c.on_death = lambda r=r: self._died(r)
        return infos[0]

    def _died(self, replica: int) -> None:
        self.index.forget(replica)
        left = len(self.live())
        if len(self.clients) > 1:
            logger.error("engine replica %d died; %d replica(s) serve on", replica, left)
        if not left and self.on_death is not None:
            self.on_death()

    async def shutdown(self, timeout: float = 5.0) -> None:
        await asyncio.gather(*(c.shutdown(timeout) for c in self.clients))

    def submit(self, rid: str, prompt_ids: Sequence[int], params: SamplingParams, sink: Sink, tag: Any) -> int:
        """EngineClient.submit on the replica chosen for this prompt (see the module docstring); returns it."""
        live = self.live()
        if not live:
            raise EngineDead("the engine is not running")
        keys = self.index.keys(prompt_ids) if len(self.clients) > 1 else []
        replica = self._choose(live, keys)
        self.clients[replica].submit(rid, prompt_ids, params, sink, tag)
        self.sent[replica] += 1
        return replica

    def _choose(self, live: List[int], keys: List[int]) -> int:
        if len(live) == 1:
            return live[0]
        loads = {r: self.clients[r].load for r in live}
        least = min(loads.values())
        chosen = self.index.longest(keys)
        if chosen not in loads or loads[chosen] - least >= AFFINITY_SLACK:
            idle = [r for r in live if loads[r] == least]
            self._turn += 1
            chosen = idle[self._turn % len(idle)]
        self.index.record(keys, chosen)
        return chosen

    def abort(self, rid: str) -> None:
        for c in self.clients:  # only the replica that holds the request acts on it
            c.abort(rid)

    async def fresh_stats(self, timeout: float = 0.5) -> Dict[str, Any]:
        await asyncio.gather(*(self.clients[r].fresh_stats(timeout) for r in self.live()))
        return self.stats

    async def flush_cache(self) -> bool:
        """Empty every live replica's prefix cache (and the index); False while any holds requests."""
        live = [self.clients[r] for r in self.live()]
        if not live:
            raise EngineDead("the engine is not running")
        if any(c.load for c in live):
            return False
        flushed = all(await asyncio.gather(*(c.flush_cache() for c in live)))
        if flushed:
            self.index.forget()
        return flushed

    def health(self) -> Dict[str, Any]:
        """/health's body while any replica serves: "degraded" while another is dead, and each one's report."""
        if len(self.clients) == 1:
            return {"status": "ok"}
        report = self.report()
        return {"status": "ok" if all(r["status"] == "ok" for r in report) else "degraded", "replicas": report}

    def report(self) -> List[Dict[str, Any]]:
        """Each replica's state for /health and /metrics (unavailable: loading or stopped)."""
        return [{"replica": r, "status": "dead" if c.dead else "ok" if c.ready else "unavailable", "pid": c.pid,
                 "sent": self.sent[r], "requests": c.load, "running": c.stats.get("num_running", 0),
                 "waiting": c.stats.get("num_waiting", 0)} for r, c in enumerate(self.clients)]
