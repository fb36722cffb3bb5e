"""`LLM(dp_size=N)`: N engine replicas for offline batch jobs, each in its own process on its own GPUs, as the
server's `--dp-size` runs them (server/replicas.py: the same processes, and the same choice of replica for each
prompt, by the prefix its radix cache likely holds and by load), except that each reports ready only once its
kernels are built and its CUDA graphs captured, as LLM(dp_size=1)'s engine does (a server's replicas answer at once
and switch to them between two steps: inside an offline call, a stretch of slow steps and a pause). The offline
API's calls drive them from an event loop kept between calls; each call's requests are spread over the replicas
and read back in order."""
from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field
from typing import Any, List, Optional, Sequence, Tuple, Union

from minisrv.checkpoints.model_files import load_tokenizer
from minisrv.config import EngineConfig
from minisrv.engine.pooling import PoolingParams
from minisrv.engine.request import RequestOutput, SamplingParams
from minisrv.server.engine_proc import Sink
from minisrv.server.replicas import Replicas


@dataclass
class Finished:
    """One request's outputs put together: what the offline API returns for it."""

    text: str = ""
    token_ids: List[int] = field(default_factory=list)
    logprobs: List[Any] = field(default_factory=list)
    prompt_logprobs: Optional[List[Any]] = None
    finish_reason: Optional[str] = None
    embedding: Optional[Any] = None  # an embedding request's vector (float32 numpy)

    def feed(self, out: RequestOutput) -> None:
        self.text += out.new_text
        self.token_ids += out.new_token_ids
        self.logprobs += out.new_logprobs
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        if out.finished:
            self.finish_reason, self.embedding = out.finish_reason, out.embedding


class ReplicaPool:
    """The replicas, started at once; `run` serves one offline call. close() stops them. `last_call`: for each
    request of the last call, (its replica, seconds from the call's start to its end), for benchmarks."""

    def __init__(self, cfg: EngineConfig, size: int) -> None:
        self._loop = asyncio.Runner()
        self.replicas = Replicas(cfg, size, staged=False)  # ready once built: no kernel switch inside a timed call
        self._ids = itertools.count()
        self.last_call: List[Tuple[int, float]] = []
        try:
            self.info = self._loop.run(self.replicas.start())
            self.tokenizer = load_tokenizer(self.info.model_path, cfg.tokenizer, cfg.cache_dir)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if not self._loop.get_loop().is_closed():
            self._loop.run(self.replicas.shutdown())
            self._loop.close()

    def run(self, prompts: Sequence[List[int]], params: Sequence[Union[SamplingParams, PoolingParams]],
            progress: Optional[Any] = None) -> List[Finished]:
        """Every prompt's request, sent at once; their results in order. A refused or failed request raises
        RuntimeError (the others are aborted), as does a replica that dies."""
        return self._loop.run(self._run(prompts, params, progress))

    async def _run(self, prompts: Sequence[List[int]], params: Sequence[Union[SamplingParams, PoolingParams]],
                   progress: Optional[Any]) -> List[Finished]:
        sink = Sink()  # (each wake-up takes a whole engine step's outputs)
        rids = [f"offline-{next(self._ids)}" for _ in prompts]
        results = [Finished() for _ in prompts]
        live = set(range(len(prompts)))
        start, self.last_call = time.perf_counter(), [(0, 0.0)] * len(prompts)
        try:
            for i, (ids, p) in enumerate(zip(prompts, params)):
                self.last_call[i] = (self.replicas.submit(rids[i], ids, p, sink, i), 0.0)
            while live:
                for i, out in await sink.take():
                    if isinstance(out, Exception):  # refused, or its replica died
                        raise RuntimeError(f"request {rids[i]} failed: {out}")
                    results[i].feed(out)
                    if out.finished:
                        live.discard(i)
                        self.last_call[i] = (self.last_call[i][0], time.perf_counter() - start)
                        if out.finish_reason == "error":
                            raise RuntimeError(f"request {rids[i]} failed: {out.error}")
                        if progress is not None:
                            progress.update(1)
        finally:
            for i in live:
                self.replicas.abort(rids[i])
        return results
