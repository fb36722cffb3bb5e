"""What the HTTP process and the engine process say to each other, one small dataclass per kind of message: a
receiver dispatches on the class, so a misspelt tag or a misplaced field fails where it is made. They travel
pickled over engine_proc.py's pipes, so they hold only plain data, SamplingParams and RequestOutput."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Union

from minisrv.engine.pooling import PoolingParams
from minisrv.engine.request import RequestLimits, RequestOutput, SamplingParams


@dataclass(frozen=True)
class EngineInfo:
    """What the HTTP side needs to know about the loaded engine; requests are checked against `limits` before
    they are sent, so the engine rarely has to refuse one."""
    model_path: str
    backend_name: str
    device: str
    context_length: int
    max_request_len: int
    vocab_size: int
    embedding_dim: int = 0  # an embedding model's vector size (it serves /v1/embeddings only); 0: a generation model

    @classmethod
    def from_engine(cls, engine: Any) -> "EngineInfo":
        p = engine.parts
        return cls(str(p.model_path), p.backend_name, str(p.device), p.context_length, p.max_request_len,
                   p.args.vocab_size, p.pooling.dim if p.pooling is not None else 0)

    @property
    def limits(self) -> RequestLimits:
        return RequestLimits(self.vocab_size, self.max_request_len)


@dataclass(frozen=True)
class AddRequest:
    """Queue a request (already validated on the HTTP side; the engine checks it again). PoolingParams in place
    of SamplingParams: an embedding request (engine/pooling.py)."""
    rid: str
    prompt_ids: List[int]
    params: Union[SamplingParams, PoolingParams]


@dataclass(frozen=True)
class AbortRequest:
    """Drop a request (its client went away): frees its KV pages."""
    rid: str


@dataclass(frozen=True)
class StatsQuery:
    """Send EngineStats now (for /metrics)."""


@dataclass(frozen=True)
class FlushCache:
    """Empty the radix prefix cache if no request is queued or running; answered by CacheFlushed(token, ...)."""
    token: int


@dataclass(frozen=True)
class Shutdown:
    """Leave the loop and exit."""


ToEngine = Union[AddRequest, AbortRequest, StatsQuery, FlushCache, Shutdown]


@dataclass(frozen=True)
class EngineReady:
    """The model is loaded; the engine reads requests from now on."""
    info: EngineInfo


@dataclass(frozen=True)
class StartupFailed:
    """The engine could not start; `detail` is the exception, one line."""
    detail: str


@dataclass(frozen=True)
class StepOutputs:
    """One engine step's news: every request that sampled a token, finished, was aborted or failed."""
    outputs: List[RequestOutput]


@dataclass(frozen=True)
class Rejected:
    """The engine refused an AddRequest (a RequestError): the fields of that error."""
    rid: str
    message: str
    param: Optional[str] = None
    code: Optional[str] = None


@dataclass(frozen=True)
class EngineStats:
    """Engine.stats(): running/waiting counts, KV pool use, prefix-cache size and hits."""
    stats: Dict[str, Any]


@dataclass(frozen=True)
class CacheFlushed:
    """The answer to FlushCache(token): ok is False when requests were queued or running (nothing was flushed)."""
    token: int
    ok: bool
