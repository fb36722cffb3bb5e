"""What minisrv adds to uvicorn: a deadline for a request to arrive, a shutdown that ends what it cuts off, and the
server's error shape with an x-request-id for what the protocol itself refuses (--limit-concurrency's 503, an
unparsable request's 400), where uvicorn answers plain text.

Read deadline. uvicorn closes an idle keep-alive connection, but any byte cancels that timer and a fresh connection
has none: a client that sends a byte now and then holds its connection (and a --limit-concurrency slot) forever.
`deadline_protocol` arms a timer when a connection opens and after each response, and closes the connection if no
route is at work when it fires; a running route times its own body reads (gate.GuardedBody, a 408).

Graceful shutdown. uvicorn waits for running requests, then cancels them: streams end with no last event and a
traceback is logged. `GracefulServer` gives them `grace` seconds, then calls ServerState.stop(): generations end
with a server_shutdown error (a 503, or a stream's error event and [DONE]), body reads with a 503. uvicorn's own
timeout comes END_S later, a last resort for a client that does not read its last event."""
from __future__ import annotations

import asyncio
import json
import uuid
from typing import TYPE_CHECKING, Any, List, Optional

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from ..errors import SERVER, APIError
from .headers import request_id, with_headers
from .policy import REQUEST_ID

if TYPE_CHECKING:
    from ..state import ServerState

END_S = 5.0  # after the stop: how long the ended requests have to deliver their last words


def deadline_protocol(read_timeout: float) -> type:
    """uvicorn's h11 protocol, with a deadline of `read_timeout` seconds for each request to arrive."""

    class DeadlineH11Protocol(H11Protocol):
        _deadline: Optional[asyncio.TimerHandle] = None

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            # --limit-concurrency: refused by _limited, in the server's error shape (see above), not by uvicorn
            self._limit, self.limit_concurrency = self.limit_concurrency, None
            if self._limit is not None:
                self.app = self._limited(self.app)

        def _limited(self, app: Any) -> Any:
            async def limited(scope: Any, receive: Any, send: Any) -> None:
                # uvicorn's rule, counted as it counts: this connection is in `connections`, and by the time the
                # app runs, this request's task is in `tasks` too
                if len(self.connections) >= self._limit or len(self.tasks) - 1 >= self._limit:
                    self.logger.warning("Exceeded concurrency limit.")
                    refusal = APIError(503, "the server is at its concurrency limit (--limit-concurrency); retry "
                                            "later", SERVER, code="server_busy", close=True)
                    send = with_headers(send, [(REQUEST_ID, request_id(scope).encode("ascii"))])
                    return await refusal.response(scope.get("path", ""))(scope, receive, send)
                return await app(scope, receive, send)
            return limited

        def send_400_response(self, msg: str) -> None:
            """A request h11 cannot parse (a malformed head, one over the head size limit), in the server's error
            shape; the connection is closed after it, as uvicorn closes it."""
            body = json.dumps(APIError(400, msg).body()).encode("utf-8")
            head = h11.Response(status_code=400, reason=b"Bad Request", headers=[
                (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode("ascii")),
                (b"connection", b"close"), (REQUEST_ID, uuid.uuid4().hex.encode("ascii"))])
            for event in (head, h11.Data(data=body), h11.EndOfMessage()):
                self.transport.write(self.conn.send(event))
            self.transport.close()

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
