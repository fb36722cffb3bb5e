"""`POST /v1/responses`: OpenAI's Responses API, stateless, over the chat completions path.

There is one generation path: a Responses request becomes a chat completion request (responses_protocol.py), which
the chat route's own function serves (templating, tools.py's plan and parsing, the reasoning split, generation.py's
engine requests, disconnects and errors); its answer, whole or streamed, is re-shaped into the Responses shapes
(responses_render.py). The chat function is handed in by routes.py when it registers this route (routes.py imports
this module, so this one cannot import routes.py back).

A failure before anything is sent is an HTTP error in OpenAI's shape, its `param` named as the Responses request
names the field (`input` for chat's `messages`, `max_output_tokens`, `text`); one after the stream began is an
`error` event that ends it. `store: true` is accepted, but nothing is stored (see responses_protocol.py).
"""
from __future__ import annotations

import contextlib
import json
from typing import Any, AsyncIterator, Awaitable, Callable, Dict

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from minisrv.engine.request import RequestError

from .errors import APIError, validation_message
from .prompts import parse_body
from .protocol import ChatCompletionRequest
from .responses_protocol import CHAT_PARAMS, ResponsesRequest, chat_body, echo_fields
from .responses_render import ResponseEvents, ResponseShape, event_text
from .state import ServerState
from .streaming import EventStream

ChatRoute = Callable[[ServerState, ChatCompletionRequest, Request, bool], Awaitable[Response]]


def add_responses_routes(app: FastAPI, state: ServerState, chat: ChatRoute) -> None:
    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        body, large = await parse_body(request, ResponsesRequest)
        return await respond(state, body, request, large, chat)


async def respond(state: ServerState, req: ResponsesRequest, request: Request, large: bool,
                  chat: ChatRoute) -> Response:
    try:
        as_chat = ChatCompletionRequest.model_validate(chat_body(req))
    except ValidationError as e:  # about the converted messages or tools: the input's
        msg, param = validation_message(e)
        raise APIError(400, msg, param=CHAT_PARAMS.get(param, param)) from None
    shape = ResponseShape(state.served_model_name, echo_fields(req), lambda text: _count(state, text))
    try:
        answer = await chat(state, as_chat, request, large)
    except (APIError, RequestError) as e:
        e.param = CHAT_PARAMS.get(e.param, e.param)
        raise
    if isinstance(answer, EventStream):
        return EventStream(_events(answer.gen, ResponseEvents(shape)))
    if answer.status_code != 200:
        return answer
    return JSONResponse(shape.whole(json.loads(answer.body)))


def _count(state: ServerState, text: str) -> int:
    """The tokens of a reasoning text (usage's reasoning_tokens; the tags around it are not counted)."""
    return len(state.tokenizer(text, add_special_tokens=False).input_ids)


async def _events(chat_events: AsyncIterator[str], events: ResponseEvents) -> AsyncIterator[str]:
    """The chat stream's SSE (`data: <chunk>` events, then `data: [DONE]`) as the Responses stream. Closing this
    closes the chat stream, which aborts its engine requests."""
    async with contextlib.aclosing(chat_events):  # type: ignore[type-var]
        for e in events.start():
            yield event_text(e)
        async for raw in chat_events:
            data = raw[len("data: "):].strip() if raw.startswith("data: ") else ""
            if not data:
                continue
            if data == "[DONE]":
                break
            chunk: Dict[str, Any] = json.loads(data)
            if "error" in chunk:
                yield event_text(events.error(chunk))
                return
            for e in events.chunk(chunk):
                yield event_text(e)
    for e in events.end():
        yield event_text(e)
