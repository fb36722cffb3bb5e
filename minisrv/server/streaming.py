"""Server-sent events, and noticing a client that goes away.

A client that disconnects must get its engine requests aborted at once (freeing their KV pages). Starlette notices
a disconnect only when a write fails, and a request the engine is not answering yet writes nothing, so
`EventStream` listens for the disconnect itself and closes the generator (whose cleanup aborts the requests); an
answer not begun yet is watched the same way by `unless_disconnected`."""
from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any, AsyncGenerator, AsyncIterator, Awaitable, Callable, Optional, TypeVar

import anyio
from fastapi import Request
from fastapi.responses import StreamingResponse

from .errors import ClientGone

SSE_DONE = "data: [DONE]\n\n"
T = TypeVar("T")


def sse(obj: Any, name: str = "") -> str:
    """One event: a pydantic model or a JSON-able object; named (`event: <name>`) when a name is given."""
    data = obj.model_dump_json() if hasattr(obj, "model_dump_json") else json.dumps(obj)
    return f"event: {name}\ndata: {data}\n\n" if name else f"data: {data}\n\n"


async def wait_disconnect(receive: Callable) -> None:
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return


class EventStream(StreamingResponse):
    """SSE that ends when the client leaves (see above). `closes`: an async generator `gen` reads from, closed too (a
    generator never started does not run its own cleanup when closed)."""

    def __init__(self, gen: AsyncIterator[str], closes: Optional[AsyncGenerator] = None) -> None:
        super().__init__(gen, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.gen, self.closes = gen, closes

    async def __call__(self, scope: Any, receive: Callable, send: Callable) -> None:
        try:
            async with anyio.create_task_group() as tg:
                async def pump() -> None:
                    with contextlib.suppress(OSError):
                        await send({"type": "http.response.start", "status": self.status_code,
                                    "headers": self.raw_headers})
                        async for chunk in self.gen:
                            if chunk:
                                await send({"type": "http.response.body", "body": chunk.encode(), "more_body": True})
                        await send({"type": "http.response.body", "body": b"", "more_body": False})
                    tg.cancel_scope.cancel()

                tg.start_soon(pump)
                await wait_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            await self.gen.aclose()  # type: ignore[attr-defined]
            if self.closes is not None:
                await self.closes.aclose()


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`; if the client disconnects first, cancel it and raise ClientGone."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(wait_disconnect(request.receive))
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    finally:
        watch.cancel()
    if task in done:
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):  # the client is gone; nothing to report to
        await task
    raise ClientGone()
