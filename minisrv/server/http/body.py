"""The request body as a route reads it: bounded in size, in time, and ended by the server's stop."""
from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Callable, Dict

from ..errors import APIError, server_shutdown

if TYPE_CHECKING:
    from ..state import ServerState


def too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than this server's limit of {limit} bytes",
                    code="request_too_large", close=True)


class GuardedBody:
    """The `receive` a route gets: while the body is read, at most `limit` bytes (413), all within `timeout` seconds of the
request's start (408), and a 503 if the server stops meanwhile; once the body is complete, `receive` itself."""

    def __init__(self, receive: Callable, state: "ServerState", limit: int, timeout: float) -> None:
        self.receive, self.state, self.limit = receive, state, limit
        self.loop = asyncio.get_running_loop()
        self.deadline = self.loop.time() + timeout
        self.timeout = timeout
        self.received = 0
        self.complete = False

    async def __call__(self) -> Dict[str, Any]:
        if self.complete:
            return await self.receive()
        if self.state.stopping:
            raise server_shutdown(close=True)
        remaining = self.deadline - self.loop.time()
        if remaining <= 0:
            raise self.timed_out()
        part = asyncio.ensure_future(self.receive())
        stop = self.loop.create_future()

        def on_stop() -> None:
            if not stop.done():
                stop.set_result(None)

        self.state.on_stop.add(on_stop)
        try:
            done, _ = await asyncio.wait({part, stop}, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
        finally:
            self.state.on_stop.discard(on_stop)
            stop.cancel()
            if not part.done():
                part.cancel()
        if part not in done:
            raise server_shutdown(close=True) if stop in done else self.timed_out()
        msg = part.result()
        if msg["type"] == "http.request":
            self.received += len(msg.get("body", b""))
            if self.received > self.limit:
                raise too_large(self.limit)
            self.complete = not msg.get("more_body", False)
        else:  # http.disconnect
            self.complete = True
        return msg

    def timed_out(self) -> APIError:
        return APIError(408, f"the request body did not arrive within {self.timeout:g} seconds",
                        code="request_timeout", close=True)
