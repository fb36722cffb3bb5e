"""Prometheus metrics of the server (`GET /metrics`): HTTP requests, engine requests by finish reason, tokens,
latencies (observed here as outputs arrive: what a client sees, IPC included), and the engine's load (added up over
the replicas, and each replica's apart).

A registry per server, not prometheus_client's global one: the in-process tests build many apps in one process.
`minisrv_cached_prompt_tokens_total` is advanced by the growth of the engine's running total since the last report
seen, so it is an ordinary counter and a report that arrives twice counts once."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Dict, List, Tuple

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5,
                   5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/embeddings", "/v1/models",  # labels
             "/v1/tokenize", "/v1/detokenize", "/v1/messages", "/v1/messages/count_tokens")
UNVERSIONED = {"/tokenize": "/v1/tokenize", "/detokenize": "/v1/detokenize"}  # the same routes without /v1
ENGINE_GAUGES = {  # an engine stats key -> its gauge's name and help
    "num_running": ("minisrv_num_requests_running", "Requests in the running batch"),
    "num_waiting": ("minisrv_num_requests_waiting", "Requests waiting to be scheduled"),
    "kv_usage": ("minisrv_kv_cache_usage_ratio", "Share of KV pool pages in use (0..1)"),
    "kv_pages_used": ("minisrv_kv_cache_pages_used", "KV pool pages in use"),
    "kv_pages_total": ("minisrv_kv_cache_pages_total", "KV pool pages"),
    "cache_tokens": ("minisrv_prefix_cache_tokens", "Tokens whose KV the radix prefix cache holds"),
}

REPLICA_GAUGES = {  # a key of Replicas.report() -> its gauge (engine replicas: --dp-size)
    "up": ("minisrv_replica_up", "1 while the engine replica serves"),
    "requests": ("minisrv_replica_requests", "Requests the server has sent the replica and not seen finish"),
    "running": ("minisrv_replica_requests_running", "Requests in the replica's running batch"),
    "waiting": ("minisrv_replica_requests_waiting", "Requests waiting in the replica"),
}


@dataclass
class TokenClock:
    """When one engine request arrived and last produced tokens, for its latency metrics."""

    arrival: float
    last: float = 0.0
    num_tokens: int = 0


class ServerMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("minisrv_requests", "HTTP requests to /v1 routes (and /tokenize, /detokenize), by "
                                "endpoint and status code", ["endpoint", "status"], registry=r)
        self.finished = Counter("minisrv_request_finish", "Engine requests (one per choice) by finish reason",
                                ["reason"], registry=r)
        self.prompt_tokens = Counter("minisrv_prompt_tokens", "Prompt tokens sent to the engine", registry=r)
        self.generation_tokens = Counter("minisrv_generation_tokens", "Tokens generated", registry=r)
        self.engine_gauges = {key: Gauge(name, doc, registry=r) for key, (name, doc) in ENGINE_GAUGES.items()}
        self.replica_gauges = {key: Gauge(name, doc, ["replica"], registry=r)
                               for key, (name, doc) in REPLICA_GAUGES.items()}
        self.spec_accept_rate = Gauge("minisrv_spec_accept_rate",
                                      "Speculative decoding: share of drafted tokens kept, since start", registry=r)
        self.spec_accept_length = Gauge("minisrv_spec_accept_length", "Speculative decoding: tokens a request gains "
                                        "per verify step (kept drafts + the target's own), since start", registry=r)
        self.cached_prompt_tokens = Counter("minisrv_cached_prompt_tokens",
                                            "Prompt tokens served from the prefix cache (not computed)", registry=r)
        self._engine_cached_prompt_tokens = 0  # the engine's running total, as last seen
        latency = functools.partial(Histogram, buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = latency("minisrv_time_to_first_token_seconds", "Time to first token")
        self.itl = latency("minisrv_inter_token_latency_seconds", "Time between consecutive output tokens")
        self.e2e = latency("minisrv_e2e_request_latency_seconds", "Time from arrival to the last token")

    def count_http(self, path: str, status: int) -> None:
        """A /v1 path's request, labelled by its route ("other": an unknown /v1 path)."""
        if path.startswith("/v1/") or path in UNVERSIONED:
            path = UNVERSIONED.get(path, path)
            label = path if path in ENDPOINTS else "/v1/models" if path.startswith("/v1/models") else "other"
            self.requests.labels(endpoint=label, status=str(status)).inc()

    def tokens(self, clock: TokenClock, k: int, t: float) -> None:
        """k new tokens of one engine request at time t: the first is its TTFT, the rest share the gap."""
        if not k:
            return
        self.generation_tokens.inc(k)
        if clock.num_tokens == 0:
            self.ttft.observe(t - clock.arrival)
        else:
            gap = (t - clock.last) / k
            for _ in range(k):
                self.itl.observe(gap)
        clock.num_tokens += k
        clock.last = t

    def ended(self, reason: str, clock: TokenClock, t: float) -> None:
        """An engine request finished in the engine (stop, length, abort, error)."""
        self.finished.labels(reason=reason).inc()
        self.e2e.observe(t - clock.arrival)

    def dropped(self, reason: str) -> None:
        """An engine request that ended on this side: aborted (its client left) or refused / engine gone."""
        self.finished.labels(reason=reason).inc()

    def exposition(self) -> Tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def set_replicas(self, report: List[Dict[str, Any]]) -> None:
        for replica in report:
            values = dict(replica, up=int(replica["status"] == "ok"))
            for key, gauge in self.replica_gauges.items():
                gauge.labels(replica=str(replica["replica"])).set(values[key])

    def set_engine_stats(self, stats: Dict[str, Any]) -> None:
        if not stats:
            return
        for key, gauge in self.engine_gauges.items():
            gauge.set(stats.get(key, 0))
        if stats.get("spec_verified_requests"):
            kept, verified = stats["spec_accepted_tokens"], stats["spec_verified_requests"]
            self.spec_accept_rate.set(kept / max(1, stats["spec_draft_tokens"]))
            self.spec_accept_length.set((kept + verified) / verified)
        total = stats.get("cached_prompt_tokens")
        if total is not None:
            if total > self._engine_cached_prompt_tokens:
                self.cached_prompt_tokens.inc(total - self._engine_cached_prompt_tokens)
            self._engine_cached_prompt_tokens = total
