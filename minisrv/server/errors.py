"""Every failure a client sees, in OpenAI's error shape: `{"error": {"message", "type", "param", "code"}}`, mapped
to its status here once (clients such as the openai package dispatch on the status and read `param`/`code`):

  400 invalid_request_error  bad JSON (also NaN/Infinity, nesting over 64 deep, lone surrogates), wrong types
                             (pydantic), out-of-range values (RequestError, with its param), too many choices
  401 / 404                  no API key (gate.py), unknown model or route
  403                        a Host or Origin this server does not answer (host_not_allowed, origin_not_allowed)
  408 / 413 / 415            the body came too slowly, is too large, is not application/json (408 and 413 close
                             the connection)
  499                        the client left before its answer (nobody reads it; counted in the metrics)
  500 server_error           the engine failed this request, or a bug
  503 server_error           the engine is loading, stopped or gone (engine_unavailable), or the shutdown's grace
                             period is over (server_shutdown; a stream ends with that error event and [DONE])

Under ANTHROPIC_PATH (/v1/messages) the same failures, with the same statuses, take Anthropic's shape instead
(`anthropic_body`); the path alone decides, so the gate's refusals answer there in that shape too."""
from __future__ import annotations

import logging
from typing import Any, Dict, Optional, Tuple

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from minisrv.engine.request import RequestError

logger = logging.getLogger("minisrv.server")

INVALID = "invalid_request_error"
SERVER = "server_error"
ANTHROPIC_PATH = "/v1/messages"
# an HTTP status -> Anthropic's error type (any other 4xx: invalid_request_error; any other 5xx: api_error)
ANTHROPIC_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                   413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


class APIError(Exception):
    """A failure with its HTTP status, raised anywhere on the request path and answered by the app's handler
    (or, once a stream has begun, sent as its last event). `close`: the answer closes the connection (the
    request's body was not read to its end)."""

    def __init__(self, status: int, message: str, type: str = INVALID, param: Optional[str] = None,
                 code: Optional[str] = None, close: bool = False) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.close = close

    def body(self) -> Dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def anthropic_body(self) -> Dict[str, Any]:
        kind = ANTHROPIC_TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "api_error")
        return {"type": "error", "error": {"type": kind, "message": self.message}}

    def response(self, path: str = "") -> JSONResponse:
        """The answer, in the shape of the API that `path` belongs to (see the module docstring)."""
        anthropic = path == ANTHROPIC_PATH or path.startswith(ANTHROPIC_PATH + "/")
        body = self.anthropic_body() if anthropic else self.body()
        return JSONResponse(body, status_code=self.status, headers={"Connection": "close"} if self.close else None)


class ClientGone(Exception):
    """The client disconnected before its answer began (a whole answer, or a stream's first bytes)."""


def from_request_error(e: RequestError) -> APIError:
    """A request that cannot be served as asked (SamplingParams, check_request, or the engine's refusal)."""
    return APIError(400, str(e), param=e.param, code=e.code)


def engine_unavailable(message: str = "the engine is not ready (still loading, or stopped)") -> APIError:
    return APIError(503, message, SERVER, code="engine_unavailable")


def server_shutdown(close: bool = False) -> APIError:
    """The server is stopping and its grace period is over: what is still running is answered with this."""
    return APIError(503, "the server is shutting down", SERVER, code="server_shutdown", close=close)


def request_failed(detail: Optional[str]) -> APIError:
    """The engine ran the request but failed it (finish_reason "error"); the other requests go on."""
    return APIError(500, f"the engine failed this request: {detail or 'unknown error'}", SERVER)


def validation_message(exc: ValidationError) -> Tuple[str, Optional[str]]:
    """pydantic's errors (a route's schema over the JSON value json_body.py decoded) -> one message naming the field,
    and the top-level field as `param`."""
    errs = exc.errors()
    loc = [str(x) for x in errs[0].get("loc", ())]
    msg = str(errs[0].get("msg", "invalid value")).removeprefix("Value error, ")
    more = f" (and {len(errs) - 1} more error{'s' if len(errs) > 2 else ''})" if len(errs) > 1 else ""
    return f"{'.'.join(loc) or 'request body'}: {msg}{more}", loc[0] if loc else None


def install_error_handlers(app: FastAPI) -> None:
    """Every exception that leaves a route answered in its API's shape (see above)."""

    async def answer(request: Request, e: Exception) -> Response:
        if isinstance(e, (ClientGone, ClientDisconnect)):  # ClientDisconnect: gone while its body was being read
            return Response(status_code=499)
        if isinstance(e, APIError):
            error = e
        elif isinstance(e, RequestError):
            error = from_request_error(e)
        elif isinstance(e, StarletteHTTPException):
            error = APIError(e.status_code, str(e.detail), INVALID if e.status_code < 500 else SERVER)
        else:
            logger.exception("unhandled error on %s", request.url.path)
            error = APIError(500, f"internal server error: {type(e).__name__}: {e}", SERVER)
        return error.response(request.url.path)

    for kind in (APIError, RequestError, StarletteHTTPException, ClientGone, ClientDisconnect, Exception):
        app.add_exception_handler(kind, answer)
