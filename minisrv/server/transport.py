"""What minisrv adds to uvicorn: a deadline for a request to arrive, and a shutdown that ends what it cuts off.

Read deadline. uvicorn (0.5x, h11) closes a keep-alive connection that stays idle for `timeout_keep_alive`, but
any byte that arrives cancels that timer, and a fresh connection has none: a client that sends half a request
head, or one byte now and then, holds its connection (and, with --limit-concurrency, a slot) forever. h11 caps
how large a request head may grow (uvicorn's `h11_max_incomplete_event_size`, 16 KiB by default), not how long
it may take. `deadline_protocol` arms a timer when a connection opens and after each response; if no route is at
work when it fires (none started, or the last one has answered), the connection is closed. While a route runs it
times its own body reads (gate.GuardedBody, a 408).

Graceful shutdown. On SIGTERM/SIGINT uvicorn stops accepting, closes idle connections and waits for the running
requests; after its `timeout_graceful_shutdown` it cancels them, which cuts streams off with no last event and
logs a traceback. `GracefulServer` lets running requests go on for `grace` seconds, then calls
ServerState.stop(): every generation still running ends with a server_shutdown error (a 503, or a stream's
error event and `data: [DONE]`) and every body still being read with a 503. uvicorn's own timeout is set
`END_S` later, a last resort for a client that does not even read its last event.
"""
from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, List, Optional

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

if TYPE_CHECKING:
    from .routes import ServerState

END_S = 5.0  # after the stop: how long the ended requests have to deliver their last words


def deadline_protocol(read_timeout: float) -> type:
    """uvicorn's h11 protocol, with a deadline of `read_timeout` seconds for each request to arrive."""

    class DeadlineH11Protocol(H11Protocol):
        _deadline: Optional[asyncio.TimerHandle] = None

        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()

        def connection_lost(self, exc: Optional[Exception]) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            if not self.transport.is_closing():
                self._deadline = self.loop.call_later(read_timeout, self._expired)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expired(self) -> None:
            self._deadline = None
            if self.cycle is not None and not self.cycle.response_complete:
                return  # a route is at work; it times its body reads itself, and re-arms this when it answers
            if not self.transport.is_closing():
                self.transport.close()

    return DeadlineH11Protocol


class GracefulServer(uvicorn.Server):
    """uvicorn's server; its shutdown gives running requests `grace` seconds, then ends them (ServerState.stop)."""

    def __init__(self, config: uvicorn.Config, state: "ServerState", grace: float) -> None:
        config.timeout_graceful_shutdown = grace + END_S  # type: ignore[assignment] - uvicorn's last resort
        super().__init__(config)
        self.state, self.grace = state, grace

    async def shutdown(self, sockets: Optional[List[Any]] = None) -> None:
        stop = asyncio.get_running_loop().call_later(self.grace, self.state.stop)
        try:
            await super().shutdown(sockets)
        finally:
            stop.cancel()
