"""`POST /v1/responses`: OpenAI's Responses API, stateless, on the shared request path."""
from __future__ import annotations

from fastapi import Request
from fastapi.responses import Response

from ..http.json_body import parse_body
from ..generation import Generation, serve
from ..plan.chat import plan_chat
from ..state import ServerState
from .protocol import ResponsesRequest, chat_inputs, echo_fields, tool_namespaces
from .render import ResponseRenderer


async def respond(state: ServerState, request: Request) -> Response:
    req, large = await parse_body(request, ResponsesRequest)
    state.check_generation_model(req.model)
    plan = await plan_chat(state.prompts, chat_inputs(req), state.info.limits, large)
    tok = state.tokenizer

    def count(text: str) -> int:
        """The tokens of a reasoning text (usage's reasoning_tokens; the tags around it are not counted)."""
        return len(tok(text, add_special_tokens=False).input_ids)

    renderer = ResponseRenderer(state.served_model_name, echo_fields(req), count, plan.tools, plan.reasoning,
                                tool_namespaces(req.tools))
    return await serve(state, request, Generation([plan.prompt_ids], plan.params), renderer, bool(req.stream))
