"""The server's HTTP app over a real engine in this process: the request path of a server, end to end on real token
streams, without starting a server process (seconds instead of a process start per test module).

`LocalEngine` stands in for server/engine_proc.py's EngineClient: submit queues a request in the engine, and a
task on the caller's event loop steps the engine while it has work, routing each output to its request's sink as
the client's receive loop does. `call` sends one request to an app through httpx's ASGI transport; `events` reads
an SSE body.
"""
from __future__ import annotations

import asyncio
import json
from typing import Any, Dict, List, Optional, Sequence, Tuple

import pytest

from minisrv.engine.request import RequestError, SamplingParams

httpx = pytest.importorskip("httpx")


class LocalEngine:
    ready, dead = True, False

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.routes: Dict[str, Tuple[asyncio.Queue, Any]] = {}
        self.task: Optional[asyncio.Task] = None
        self.submitted: List[SamplingParams] = []

    def submit(self, rid: str, prompt_ids: Sequence[int], params: SamplingParams, sink: asyncio.Queue,
               tag: Any) -> None:
        self.submitted.append(params)
        try:
            self.engine.add(self.engine.make_request(prompt_ids, params, rid))
        except RequestError as e:
            sink.put_nowait((tag, e))
            return
        self.routes[rid] = (sink, tag)
        if self.task is None or self.task.done():
            self.task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while self.engine.has_work():
            for out in self.engine.step():
                route = self.routes.get(out.rid)
                if route is not None:
                    route[0].put_nowait((route[1], out))
                    if out.finished:
                        del self.routes[out.rid]
            await asyncio.sleep(0)

    def abort(self, rid: str) -> None:
        self.routes.pop(rid, None)
        self.engine.abort(rid)

    async def fresh_stats(self, timeout: float = 0.5) -> Dict[str, Any]:
        return {}


def call(app: Any, path: str, body: Dict[str, Any]) -> httpx.Response:
    async def run() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as h:
            return await h.post(path, json=body, timeout=120)
    return asyncio.run(run())


def events(r: httpx.Response) -> List[Any]:
    out = []
    for line in r.text.split("\n\n"):
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def events_of(framed: List[str]) -> List[Dict[str, Any]]:
    """Server-sent events (`event: <name>` + `data: <json>`) as their data, which names its type too."""
    out = []
    for text in framed:
        name, data = text.strip().split("\n")
        assert name.startswith("event: ") and data.startswith("data: ")
        out.append(json.loads(data[len("data: "):]))
        assert out[-1]["type"] == name[len("event: "):]
    return out
